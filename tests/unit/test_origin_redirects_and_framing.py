"""Redirects, host names and response framing at their edges.

A password holding ``#`` or ``?`` never shows in a redacted URL; an internationalised
host is one host in both its spellings (a same-host redirect is followed, a refusal
is the origin's own); an origin URL with user-info follows a relative redirect and
sends its credentials to its own host only; ``Transfer-Encoding: chunked`` overrides
``Content-Length``; a ``file://`` origin must name an existing directory; an interim
``103 Early Hints`` is passed over to the final response, and a status HTTP does not
define is not retried.
"""

from __future__ import annotations

import base64
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distcache._urls import redact_url
from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ConfigError, OriginError
from distcache.origins import Credentials, HttpOrigin, open_origin
from distcache.origins._credentials import host_key, parse_tokens
from distcache.origins._response import redirect_target
from tests.support.origins import Responder, ThreadedRawServer, closing_fixture, servers_fixture

BODY = bytes(range(256)) * 40  # 10240 bytes
SHA = sha256_hex(BODY)
ARTIFACT = Artifact("fmha/k.cubin", SHA, len(BODY))
UNSIZED = Artifact("fmha/k.cubin", SHA)
TOKEN = "tok-redirects-and-framing-0123"
IDN = "bücher.example"
IDN_ASCII = "xn--bcher-kva.example"


raw = servers_fixture(ThreadedRawServer)
_opened: list[HttpOrigin] = []
_close_origins = closing_fixture(_opened)


@pytest.fixture
def loopback_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's host names resolve to 127.0.0.1, and no proxy is in the way."""
    real = socket.getaddrinfo
    names = {IDN_ASCII, IDN, "other.example"}

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        return real("127.0.0.1" if host in names else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    for variable in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(variable, raising=False)


def http_origin(url: str, **kwargs: Any) -> HttpOrigin:
    kwargs.setdefault("retries", 0)
    kwargs.setdefault("timeout", 2.0)
    _opened.append(HttpOrigin(url, **kwargs))
    return _opened[-1]


def head(status: str, headers: list[tuple[str, str]]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return f"HTTP/1.1 {status}\r\n{lines}Connection: close\r\n\r\n".encode()


def ok() -> bytes:
    return head("200 OK", [("Content-Length", str(len(BODY)))]) + BODY


def found(location: str) -> bytes:
    return head("302 Found", [("Location", location), ("Content-Length", "0")])


def header(request: bytes, name: str) -> str | None:
    for line in request.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def path_of(request: bytes) -> str:
    return request.split(b" ")[1].decode()


# -- a password holding "#" or "?" ---------------------------------------------------


@pytest.mark.parametrize(("url", "shown"), [
    ("alice:Hunter2#xYz9@mirror.example/cubins", "...@mirror.example/cubins"),
    ("alice:Hunter2?xYz9@mirror.example:8000", "...@mirror.example:8000"),
    ("https://alice:Hunter2#xYz9@mirror.example/cubins", "https://...@mirror.example/cubins"),
    # A port of digits: user-info, or a host and a query or fragment holding an "@".
    ("https://alice:4711#xYz9@mirror.example/cubins", "https://..."),
    ("https://alice:4711?xYz9@mirror.example/cubins", "https://..."),
    ("https://alice:4711#a/b@mirror.example/cubins", "https://..."),
    ("https://alice#xYz9@mirror.example/", "https://..."),
    ("https://cdn.example:8443?sig=SEC@RET/x", "https://..."),
    ("alice:4711#xYz9@mirror.example/cubins", "..."),
    # A "://" in the password is no scheme, also where the host cannot be read.
    ("alice:SEC[://RET@[::1]/c", "..."),
])
def test_a_password_holding_a_hash_or_a_question_mark_is_hidden_whole(
        url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_an_origin_whose_password_holds_a_hash_shows_none_of_it() -> None:
    origin = http_origin("https://alice:4711#Zq@mirror.example/cubins")
    for text in (origin.describe(), repr(origin)):
        assert "alice" not in text and "4711" not in text and "Zq" not in text
    with pytest.raises(ConfigError) as info:
        open_origin("alice:Hunter2#xYz9@mirror.example/cubins",
                    credentials=Credentials.none())
    assert "Hunter2" not in str(info.value) and "alice" not in str(info.value)
    assert "Hunter2" not in repr(info.value.value)


@pytest.mark.parametrize("url", [
    "https://mirror.example/pkg@1.0/k.cubin",
    "https://alice:pw@mirror.example/cubins",
    "https://mirror.example:8443/cubins?sig=a#frag",
])
def test_an_ordinary_url_is_shown_as_before(url: str) -> None:
    assert redact_url(url) == url.replace("alice:pw@", "").split("?")[0]


# -- internationalised host names ------------------------------------------------------


def test_a_host_is_one_host_in_both_its_spellings() -> None:
    assert host_key(f"http://{IDN}:8000/c") == host_key(f"http://{IDN_ASCII}:8000/c")
    assert host_key("https://BÜCHER.example/c") == ("https", IDN_ASCII, 443)
    assert parse_tokens(f"{IDN}=T")[("https", IDN_ASCII, 443)] == "T"
    credentials = Credentials(parse_tokens(f"{IDN}:8000=T"))
    assert credentials.token_for(f"http://{IDN_ASCII}:8000/c") == "T"


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("loopback_names")
def test_a_same_host_redirect_on_an_idn_host_is_followed_with_the_token(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(found("/blobs/k.cubin") if path_of(request).startswith("/c/") else ok())

    server = raw(respond)
    port = server.url.rpartition(":")[2]
    origin = http_origin(f"http://{IDN}:{port}/c", token=TOKEN)
    assert origin.fetch(ARTIFACT) == BODY
    assert [path_of(r) for r in server.requests] == ["/c/fmha/k.cubin", "/blobs/k.cubin"]
    assert [header(r, "Authorization") for r in server.requests] == [f"Bearer {TOKEN}"] * 2


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("loopback_names")
def test_a_refusal_by_an_idn_origin_is_the_origins_own(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(head("401 Unauthorized", [("Content-Length", "0")]))

    server = raw(respond)
    port = server.url.rpartition(":")[2]
    with pytest.raises(OriginError) as info:
        http_origin(f"http://{IDN}:{port}/c", token=TOKEN).fetch(ARTIFACT)
    assert info.value.status == 401
    assert "redirect target" not in str(info.value)
    assert "DISTCACHE_ORIGIN_TOKEN" in str(info.value)
    assert len(server.requests) == 1


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("loopback_names")
def test_an_idn_host_allowed_by_its_unicode_name_is_followed_without_the_token(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(found(f"http://{IDN_ASCII}:{port}/blobs/k.cubin")
                     if index == 0 else ok())

    server = raw(respond)
    port = server.url.rpartition(":")[2]
    origin = http_origin(server.url, token=TOKEN, allow_redirect_hosts=["BÜCHER.example"])
    assert origin.fetch(ARTIFACT) == BODY
    assert header(server.requests[1], "Host") == f"{IDN_ASCII}:{port}"
    assert [header(r, "Authorization") for r in server.requests] == [f"Bearer {TOKEN}", None]


# -- an origin URL with user-info ------------------------------------------------------


BASIC = "Basic " + base64.b64encode(b"alice:s3cret").decode()


@pytest.mark.timeout(30)
def test_an_origin_with_user_info_follows_a_relative_redirect_with_its_credentials(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        if header(request, "Authorization") != BASIC:
            conn.sendall(head("401 Unauthorized", [("Content-Length", "0")]))
        elif path_of(request).startswith("/c/"):
            conn.sendall(found("/blobs/k.cubin"))
        else:
            conn.sendall(ok())

    server = raw(respond)
    origin = http_origin(server.url.replace("http://", "http://alice:s3cret@") + "/c")
    assert origin.fetch(ARTIFACT) == BODY
    assert [path_of(r) for r in server.requests] == ["/c/fmha/k.cubin", "/blobs/k.cubin"]


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("loopback_names")
def test_the_credentials_of_an_origin_url_never_go_to_another_host(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(found(f"http://other.example:{port}/blobs/k.cubin")
                     if index == 0 else ok())

    server = raw(respond)
    port = server.url.rpartition(":")[2]
    origin = http_origin(server.url.replace("http://", "http://alice:s3cret@"),
                         allow_redirect_hosts=["other.example"])
    assert origin.fetch(ARTIFACT) == BODY
    assert header(server.requests[1], "Host") == f"other.example:{port}"
    assert [header(r, "Authorization") for r in server.requests] == [BASIC, None]


@pytest.mark.parametrize(("current", "location", "expected"), [
    ("http://alice:pw@h:8000/c/a", "/b", "http://alice:pw@h:8000/b"),
    ("http://alice:pw@h:8000/c/a", "b", "http://alice:pw@h:8000/c/b"),
    ("http://alice:pw@h:8000/c/a", "http://other:8000/b", "http://other:8000/b"),
    ("http://alice:pw@h:8000/c/a", "//h:8001/b", "http://h:8001/b"),
])
def test_a_redirect_keeps_the_user_info_on_its_own_host_only(
        current: str, location: str, expected: str) -> None:
    assert redirect_target(current, location) == expected


@pytest.mark.parametrize("location", ["//u:p@h:8000/b", "http://u@h:8000/b"])
def test_a_location_with_its_own_user_info_is_still_refused(location: str) -> None:
    with pytest.raises(ValueError):
        redirect_target("http://alice:pw@h:8000/c/a", location)


# -- framing -------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("artifact", [ARTIFACT, UNSIZED], ids=["sized", "unsized"])
def test_a_chunked_body_is_not_judged_by_its_content_length(
    raw: Callable[[Responder], ThreadedRawServer], artifact: Artifact,
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(head("200 OK", [("Content-Length", "7"),
                                     ("Transfer-Encoding", "chunked")])
                     + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n")

    server = raw(respond)
    assert http_origin(server.url, retries=2, sleep=lambda _s: None).fetch(artifact) == BODY
    assert len(server.requests) == 1


@pytest.mark.timeout(30)
def test_an_early_hints_response_is_passed_over_to_the_final_one(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 103 Early Hints\r\nLink: </x.css>; rel=preload\r\n\r\n")
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.sendall(ok())

    server = raw(respond)
    assert http_origin(server.url, retries=2).fetch(ARTIFACT) == BODY
    assert len(server.requests) == 1


@pytest.mark.timeout(30)
def test_endless_interim_responses_fail_the_attempt(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 103 Early Hints\r\n\r\n" * 1000 + ok())

    server = raw(respond)
    with pytest.raises(OriginError, match="interim"):
        http_origin(server.url).fetch(ARTIFACT)
    assert len(server.requests) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", ["600 Weird", "999 Odd"])
def test_a_status_http_does_not_define_is_not_retried(
    raw: Callable[[Responder], ThreadedRawServer], status: str,
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(head(status, [("Content-Length", "0")]))

    server = raw(respond)
    waits: list[float] = []
    with pytest.raises(OriginError, match=status.split()[0]):
        http_origin(server.url, retries=3, sleep=waits.append).fetch(ARTIFACT)
    assert len(server.requests) == 1 and waits == []


@pytest.mark.parametrize("name", ["retries", "max_bytes"])
@pytest.mark.parametrize("value", [2.5, True, "3"])
def test_retries_and_the_byte_cap_must_be_integers(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=name):
        HttpOrigin("http://127.0.0.1:9", **{name: value})


# -- file:// origins -------------------------------------------------------------------


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_file_url_must_name_an_existing_directory(tmp_path: Path, what: str) -> None:
    target = tmp_path / "mirror-typo"
    if what == "file":
        target.write_bytes(b"x")
    with pytest.raises(ConfigError, match="file://") as info:
        open_origin(f"file://{target}", credentials=Credentials.none())
    assert str(target) in str(info.value)
    assert ("no such directory" if what == "missing" else "a file") in str(info.value)
