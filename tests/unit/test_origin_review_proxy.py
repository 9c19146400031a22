"""An HTTP origin behind a proxy (``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``).

A proxy that refuses the tunnel to the origin (407: its credentials are missing, 403:
its policy forbids the host) answers the same to every attempt: the fetch fails at
once, saying to check the proxy, instead of after every attempt and its backoff, for
each artifact. A proxy that is down is named as what is unreachable: the origin was
never asked. A proxy's own failure to reach the origin (502) is still retried.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ArtifactNotFound, OriginError, OriginUnreachable
from distcache.origins import HttpOrigin
from tests.support.origins import ThreadedRawServer, close_all

BODY = bytes(range(256)) * 4
ARTIFACT = Artifact("fmha/k.cubin", sha256_hex(BODY), len(BODY))
_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "REQUEST_METHOD")

_opened: list[Any] = []
_servers: list[ThreadedRawServer] = []


@pytest.fixture(autouse=True)
def _no_proxy_from_outside(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    yield
    close_all(_opened)
    while _servers:
        _servers.pop().close()


def _server(status: str) -> ThreadedRawServer:
    """A proxy answering every request (a CONNECT, a GET) with ``status``."""

    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Length: 0\r\n"
                     "Connection: close\r\n\r\n".encode())

    _servers.append(ThreadedRawServer(respond))
    return _servers[-1]


def _origin(url: str, waits: list[float]) -> HttpOrigin:
    _opened.append(HttpOrigin(url, retries=4, timeout=5.0, sleep=waits.append))
    return _opened[-1]


@pytest.mark.parametrize("status", ["407 Proxy Authentication Required", "403 Forbidden",
                                    "404 Not Found"])
def test_a_proxy_refusing_the_tunnel_fails_the_fetch_at_once(
    status: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = _server(status)
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    waits: list[float] = []
    with pytest.raises(OriginError) as caught:
        _origin("https://mirror.example/cubins", waits).fetch(ARTIFACT)
    # Before: 5 CONNECTs and 4 waits per artifact, then "check the network".
    assert [r.split(b" ", 1)[0] for r in proxy.requests] == [b"CONNECT"]
    assert waits == []
    # The proxy's 404 is not the origin's: the artifact is not "not found".
    assert not isinstance(caught.value, ArtifactNotFound)
    assert caught.value.status is None
    assert "proxy" in caught.value.message.partition("; ")[2]
    assert status.split()[0] in caught.value.message


def test_a_proxy_that_cannot_reach_the_origin_is_still_retried(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = _server("502 Bad Gateway")
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    waits: list[float] = []
    with pytest.raises(OriginError):
        _origin("https://mirror.example/cubins", waits).fetch(ARTIFACT)
    assert len(proxy.requests) == 5 and len(waits) == 4


def test_a_proxy_that_is_down_is_named_as_what_is_unreachable(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://puser:proxy-pass-6d1f@127.0.0.1:{port}")
    with pytest.raises(OriginUnreachable) as caught:
        _origin("http://mirror.example/cubins", []).fetch(ARTIFACT)
    message = caught.value.message
    # Before: "origin http://mirror.example/cubins is unreachable: connection refused".
    assert f"proxy http://127.0.0.1:{port}" in message
    assert "proxy-pass-6d1f" not in message and "puser" not in message
    assert "proxy-pass-6d1f" not in str(caught.value.cause)


def test_no_proxy_still_sends_the_origin_past_the_proxy(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = _server("407 Proxy Authentication Required")

    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {len(BODY)}\r\n"
                     "Connection: close\r\n\r\n".encode() + BODY)

    _servers.append(ThreadedRawServer(respond))
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", "localhost")
    url = _servers[-1].url.replace("127.0.0.1", "localhost")
    assert _origin(url, []).fetch(ARTIFACT) == BODY
    assert proxy.requests == []
