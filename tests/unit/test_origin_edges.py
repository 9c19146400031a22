"""Origins at their edges: redirect bodies, size caps, file URLs, chains.

A threaded raw socket server answers each connection with whatever a test hands it,
so a response can stall, trickle or lie while the next connection is served.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ConfigError, OriginError
from distcache.origins import Credentials, DirOrigin, HttpOrigin, open_origin
from tests.support.origins import Responder, ThreadedRawServer, closing_fixture, servers_fixture

BODY = bytes(range(256)) * 40  # 10240 bytes
SHA = sha256_hex(BODY)
ARTIFACT = Artifact("fmha/k.cubin", SHA, len(BODY))

raw = servers_fixture(ThreadedRawServer)
_opened: list[HttpOrigin] = []
_close_origins = closing_fixture(_opened)


def http_origin(url: str, **kwargs: Any) -> HttpOrigin:
    kwargs.setdefault("retries", 0)
    kwargs.setdefault("timeout", 1.0)
    _opened.append(HttpOrigin(url, sleep=lambda _s: None, **kwargs))
    return _opened[-1]


def head(status: str, headers: list[tuple[str, str]]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return f"HTTP/1.1 {status}\r\n{lines}Connection: close\r\n\r\n".encode()


# -- HTTP -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_redirect_is_followed_without_reading_its_body(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    # A redirect announcing a huge body that never comes: its body is none of the
    # client's business, and waiting for it would stall (or fill memory).
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        if request.startswith(b"GET /fmha/k.cubin "):
            conn.sendall(head("302 Found", [("Location", "/real/k.cubin"),
                                            ("Content-Length", str(1 << 40))]))
            conn.sendall(b"x" * 1024)
            server.stop.wait(10)
        else:
            conn.sendall(head("200 OK", [("Content-Length", str(len(BODY)))]) + BODY)

    server = raw(respond)
    started = time.monotonic()
    assert http_origin(server.url).fetch(ARTIFACT) == BODY
    assert time.monotonic() - started < 0.9  # under one read timeout



@pytest.mark.timeout(30)
def test_a_content_coded_body_that_never_ends_fails_naming_its_encoding(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    # Empty deflate blocks arrive steadily (no read ever times out) and would decode to
    # no bytes at all, for ever: the bytes as sent are read (their digest decides), far
    # too slowly, and the failure says how they were coded.
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(head("200 OK", [("Content-Encoding", "deflate"),
                                     ("Transfer-Encoding", "chunked")]))
        conn.sendall(b"2\r\n\x78\x9c\r\n")
        while not server.stop.wait(0.05):
            conn.sendall(b"a\r\n" + b"\x00\x00\x00\xff\xff" * 2 + b"\r\n")

    server = raw(respond)
    outcome: list[BaseException | bytes] = []

    def fetch() -> None:
        try:
            outcome.append(http_origin(server.url).fetch(Artifact("fmha/k.cubin", SHA)))
        except BaseException as exc:  # reported to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(10)
    finished = not thread.is_alive()
    server.stop.set()  # ends the body, so a fetch still reading returns
    thread.join(10)
    assert finished, "the fetch was still reading a body that delivered nothing"
    assert isinstance(outcome[0], OriginError)
    assert "Content-Encoding: deflate" in str(outcome[0])


def test_a_certificate_that_fails_verification_is_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ssl

    import requests
    import urllib3

    from distcache.origins import _response

    calls: list[str] = []

    class RefusingSession:
        def get(self, url: str, **kwargs: Any) -> Any:
            calls.append(url)
            verify = ssl.SSLCertVerificationError(
                1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
            reason = urllib3.exceptions.SSLError(verify)
            raise requests.exceptions.SSLError(
                urllib3.exceptions.MaxRetryError(None, url, reason))  # type: ignore[arg-type]

        def close(self) -> None:
            pass

    monkeypatch.setattr(_response, "new_session", lambda _size: RefusingSession())
    waits: list[float] = []
    origin = HttpOrigin("https://mirror.example/cubins", retries=4, sleep=waits.append)
    with pytest.raises(OriginError, match="CERTIFICATE_VERIFY_FAILED") as info:
        origin.fetch(ARTIFACT)
    assert len(calls) == 1 and waits == []
    assert info.value.status is None


@pytest.mark.timeout(30)
def test_a_refusal_by_a_redirect_target_names_it_and_does_not_blame_the_token(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    # The origin (127.0.0.1) redirects to an allowed host (localhost) that gets no
    # token; its 403 is that host's, not a verdict on the token.
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        if request.startswith(b"GET /fmha/k.cubin "):
            conn.sendall(head("302 Found", [("Location", f"{cdn}/signed/k.cubin"),
                                            ("Content-Length", "0")]))
        else:
            conn.sendall(head("403 Forbidden", [("Content-Length", "0")]))

    server = raw(respond)
    cdn = server.url.replace("127.0.0.1", "localhost")
    origin = http_origin(server.url, token="sekrit", allow_redirect_hosts=["localhost"])
    with pytest.raises(OriginError) as info:
        origin.fetch(ARTIFACT)
    message = str(info.value)
    assert info.value.status == 403
    assert f"{cdn}/signed/k.cubin" in message and "redirect" in message
    assert "DISTCACHE_ORIGIN_TOKEN" not in message and "sekrit" not in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("status", ["501 Not Implemented", "505 HTTP Version Not Supported"])
def test_a_server_error_no_attempt_can_change_is_not_retried(
    raw: Callable[[Responder], ThreadedRawServer], status: str,
) -> None:
    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(head(status, [("Content-Length", "0")]))

    server = raw(respond)
    with pytest.raises(OriginError, match=status.split()[0]):
        http_origin(server.url, retries=3).fetch(ARTIFACT)
    assert len(server.requests) == 1

# -- directories ------------------------------------------------------------------


def test_dir_origin_refuses_an_unsized_file_over_the_byte_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", "4096")
    (tmp_path / "big.cubin").write_bytes(BODY)
    out = io.BytesIO()
    with pytest.raises(OriginError, match="4096"):
        DirOrigin(tmp_path).fetch_into(Artifact("big.cubin", SHA), out)
    assert out.getvalue() == b""
    # Under the cap, an unsized artifact is read as before.
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", str(len(BODY)))
    assert DirOrigin(tmp_path).fetch(Artifact("big.cubin", SHA)) == BODY


# -- open_origin ------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["file://cubins", "file://cubins/fmha", "file://"])
def test_a_file_url_with_a_host_or_no_path_is_refused_not_read_elsewhere(spec: str) -> None:
    # file://cubins/fmha is a relative path written as a URL: read as /fmha (or, with
    # no path, as the working directory) it would serve another directory's files.
    with pytest.raises(ConfigError, match="file://"):
        open_origin(spec, credentials=Credentials.none())


def test_a_file_url_on_localhost_is_the_local_path(tmp_path: Path) -> None:
    origin = open_origin(f"file://localhost{tmp_path}", credentials=Credentials.none())
    assert isinstance(origin, DirOrigin) and origin.path == tmp_path
