"""What an HTTP origin sends and says, header by header.

A header name is case-insensitive (RFC 9110 5.1): a caller's ``authorization`` header
is its credential as much as ``Authorization`` is, and ``~/.netrc`` must not replace
it. A hostile server's ``Location`` (up to 64 KiB) is not copied whole into the error
and the log lines that quote a refused redirect. An integrity error names its artifact
in its ``name`` attribute, from a single origin as from a chain.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import IntegrityError, OriginError
from distcache.origins import DirOrigin, HttpOrigin
from tests.support.origins import ThreadedRawServer, close_all

BODY = bytes(range(256)) * 4
ARTIFACT = Artifact("fmha/k.cubin", sha256_hex(BODY), len(BODY))
WRONG = Artifact("fmha/k.cubin", "0" * 64, len(BODY))

_opened: list[Any] = []
_servers: list[ThreadedRawServer] = []


@pytest.fixture(autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    close_all(_opened)
    while _servers:
        _servers.pop().close()


def _serve(head: str, body: bytes = b"") -> ThreadedRawServer:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(f"HTTP/1.1 {head}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)

    _servers.append(ThreadedRawServer(respond))
    return _servers[-1]


def _origin(url: str, **kwargs: Any) -> HttpOrigin:
    _opened.append(HttpOrigin(url, retries=0, timeout=5.0, **kwargs))
    return _opened[-1]


def _authorization(request: bytes) -> list[bytes]:
    return [line for line in request.split(b"\r\n") if line.lower().startswith(b"authorization:")]


def _netrc_for_localhost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``~/.netrc`` (through ``NETRC``) with a login for 127.0.0.1."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login bob password netrc-pass-91c2\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))


@pytest.mark.parametrize("name", ["Authorization", "authorization", "AUTHORIZATION"])
def test_a_callers_authorization_header_wins_over_netrc_in_any_case(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _netrc_for_localhost(tmp_path, monkeypatch)
    server = _serve("200 OK", BODY)
    assert _origin(server.url, headers={name: "Bearer callers-own-7e3a"}).fetch(ARTIFACT) == BODY
    # Before, in lower case: "Authorization: Basic Ym9iOm5ldHJjLXBhc3MtOTFjMg==" (netrc's).
    sent = _authorization(server.requests[0])
    assert len(sent) == 1 and sent[0].endswith(b"Bearer callers-own-7e3a")


def test_netrc_still_serves_an_origin_given_no_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _netrc_for_localhost(tmp_path, monkeypatch)
    server = _serve("200 OK", BODY)
    assert _origin(server.url, headers={"X-Trace": "1"}).fetch(ARTIFACT) == BODY
    assert _authorization(server.requests[0])[0].startswith(b"Authorization: Basic ")


@pytest.mark.parametrize("target", ["http://other.example/", "https://127.0.0.1/",
                                    "http://127.0.0.1:1/"])
def test_a_huge_location_is_not_copied_whole_into_the_error(target: str) -> None:
    location = target + "p" * 60000
    server = _serve(f"302 Found\r\nLocation: {location}")
    origin = _origin(server.url, allow_redirect_hosts=["127.0.0.1"])
    with pytest.raises(OriginError) as caught:
        origin.fetch(ARTIFACT)
    # Before: 60,206 characters, the whole Location.
    assert len(caught.value.message) < 1000
    assert "redirect" in caught.value.message


def test_a_refusal_by_a_redirect_target_does_not_quote_its_huge_url() -> None:
    target = _serve("403 Forbidden")
    origin_server = _serve(f"302 Found\r\nLocation: {target.url}/{'q' * 60000}")
    origin = _origin(origin_server.url.replace("127.0.0.1", "localhost"),
                     allow_redirect_hosts=["127.0.0.1"])
    with pytest.raises(OriginError) as caught:
        origin.fetch(ARTIFACT)
    assert len(target.requests) == 1
    assert "redirect target" in caught.value.message
    assert len(caught.value.message) < 1000


def test_an_http_integrity_error_names_its_artifact() -> None:
    server = _serve("200 OK", BODY)
    with pytest.raises(IntegrityError) as caught:
        _origin(server.url).fetch(WRONG)
    assert caught.value.name == WRONG.name


def test_a_mirror_integrity_error_names_its_artifact(tmp_path: Path) -> None:
    (tmp_path / "fmha").mkdir()
    (tmp_path / "fmha" / "k.cubin").write_bytes(BODY)
    with pytest.raises(IntegrityError) as caught:
        DirOrigin(tmp_path).fetch(WRONG)
    assert caught.value.name == WRONG.name
