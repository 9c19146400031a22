"""What a redirect target gets: no cookie of the origin's, and no say over the origin.

An origin that sends one artifact to another host (allowed), which refuses
connections, is itself up: the artifacts it serves keep coming from it, the failure
names the redirect target, and no OriginChain skips the origin as down for them.
A refused connection at the origin itself still marks it down (the guard). A cookie
the origin sets ignores ports: it reached another port of the origin's host that a
redirect named, where neither the token nor the caller's headers go.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import OriginError, OriginUnreachable
from distcache.origins import HttpOrigin, OriginChain
from tests.support.origins import Responder, ThreadedRawServer, closing_fixture, servers_fixture

BODY = bytes(range(256)) * 8
SHA = sha256_hex(BODY)
SENT_AWAY = Artifact("a.cubin", SHA, len(BODY))
SERVED = Artifact("b.cubin", SHA, len(BODY))

raw = servers_fixture(ThreadedRawServer)
_opened: list[Any] = []
_close_origins = closing_fixture(_opened)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _head(status: str, headers: list[tuple[str, str]]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return f"HTTP/1.1 {status}\r\n{lines}Connection: close\r\n\r\n".encode()


def _origin(url: str, **kwargs: Any) -> HttpOrigin:
    _opened.append(HttpOrigin(url, retries=0, timeout=5.0, **kwargs))
    return _opened[-1]


@pytest.fixture
def sending_a_away(raw: Callable[[Responder], ThreadedRawServer]) -> ThreadedRawServer:
    dead = _closed_port()

    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        path = request.split(b" ", 2)[1]
        if path.endswith(b"/a.cubin"):
            conn.sendall(_head("302 Found", [("Location", f"http://localhost:{dead}/a.cubin"),
                                             ("Content-Length", "0")]))
        else:
            conn.sendall(_head("200 OK", [("Content-Length", str(len(BODY)))]) + BODY)

    return raw(respond)


@pytest.mark.timeout(60)
def test_an_unreachable_redirect_target_fails_only_that_artifact(
    sending_a_away: ThreadedRawServer,
) -> None:
    origin = _origin(f"{sending_a_away.url}/c", allow_redirect_hosts=["localhost"])
    with pytest.raises(OriginError) as info:
        origin.fetch(SENT_AWAY)
    assert not isinstance(info.value, OriginUnreachable)
    assert "redirect target" in str(info.value) and "localhost" in str(info.value)
    assert origin.fetch(SERVED) == BODY  # the origin is not taken for down
    assert [r.split(b" ", 2)[1] for r in sending_a_away.requests] == [b"/c/a.cubin",
                                                                       b"/c/b.cubin"]


@pytest.mark.timeout(60)
def test_a_chain_keeps_asking_an_origin_whose_redirect_target_is_down(
    sending_a_away: ThreadedRawServer,
) -> None:
    chain = OriginChain([_origin(f"{sending_a_away.url}/c",
                                 allow_redirect_hosts=["localhost"])])
    with pytest.raises(OriginError):
        chain.fetch(SENT_AWAY)
    assert chain.fetch(SERVED) == BODY


@pytest.mark.timeout(60)
def test_a_refusing_origin_is_still_marked_down() -> None:
    origin = _origin(f"http://127.0.0.1:{_closed_port()}/c")
    with pytest.raises(OriginUnreachable):
        origin.fetch(SENT_AWAY)
    with pytest.raises(OriginUnreachable, match="not asked again"):
        origin.fetch(SERVED)


@pytest.mark.timeout(60)
def test_a_cookie_the_origin_sets_is_not_sent_to_another_port_of_its_host(
    raw: Callable[[Responder], ThreadedRawServer],
) -> None:
    def serve(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(_head("200 OK", [("Content-Length", str(len(BODY)))]) + BODY)

    target = raw(serve)

    def send_away(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(_head("302 Found", [("Location", f"{target.url}/x/a.cubin"),
                                         ("Set-Cookie", "sess=SECRET-COOKIE; Path=/"),
                                         ("Content-Length", "0")]))

    origin_server = raw(send_away)
    origin = _origin(f"{origin_server.url}/c", token="tok-cookie-0123",
                     headers={"X-Api-Key": "key-0123"}, allow_redirect_hosts=["127.0.0.1"])
    assert origin.fetch(SENT_AWAY) == BODY
    assert origin.fetch(SENT_AWAY) == BODY  # the origin asked again, after its cookie
    sent = b"".join(target.requests + origin_server.requests[1:])
    assert len(target.requests) == 2 and len(origin_server.requests) == 2
    assert b"SECRET-COOKIE" not in sent
    for request in target.requests:
        assert b"tok-cookie-0123" not in request and b"key-0123" not in request
