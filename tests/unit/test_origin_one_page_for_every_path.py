"""An origin that answers every path with one page (a sign-in page, a portal, an
index) fails the fetch once three different artifacts came back as that body, naming
its size and type, instead of after every artifact's retries (320 requests and a
minute for 64 artifacts before). Two artifacts that a broken mirror left alike (empty
files) are each their own failure, and the others are still served."""

from __future__ import annotations

import io
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.comm import local
from distcache.errors import IntegrityError, OriginError, PrefetchError
from distcache.origins import HttpOrigin
from distcache.session import SessionSlot
from tests.support.origins import Responder, ThreadedRawServer, closing_fixture, servers_fixture

PAGE = b"<html><body>Please sign in</body></html>"
raw = servers_fixture(ThreadedRawServer)
_opened: list[Any] = []
_close_origins = closing_fixture(_opened)


def _artifacts(n: int, *, sized: bool) -> list[Artifact]:
    datas = [f"kernel {i}\n".encode() * (100 + i) for i in range(n)]
    return [Artifact(f"k/{i}.cubin", sha256_hex(d), len(d) if sized else None)
            for i, d in enumerate(datas)]


def _one_page(index: int, request: bytes, conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(PAGE) + PAGE)


@pytest.mark.parametrize("sized", [False, True], ids=["digest", "announced-size"])
def test_init_against_one_page_for_every_path_fails_at_once(
        tmp_path: Path, raw: Callable[[Responder], ThreadedRawServer], sized: bool) -> None:
    server = raw(_one_page)
    artifacts = _artifacts(24, sized=sized)
    with pytest.raises(PrefetchError) as raised:
        SessionSlot().init(comm=local(), pool=str(tmp_path / "pool"), origin=server.url,
                           manifests=[artifacts], integrations=[], timeout=60)
    said = str(raised.value)
    assert "the same body" in said and "text/html" in said, said
    assert f"{len(PAGE)} bytes" in said, said
    # Each artifact would have been asked 5 times (120 requests): the fetch stopped.
    assert len(server.requests) < len(artifacts), len(server.requests)


def test_two_artifacts_left_alike_fail_alone_and_the_rest_are_served(
        raw: Callable[[Responder], ThreadedRawServer]) -> None:
    artifacts = _artifacts(6, sized=False)
    datas = {a.name: f"kernel {i}\n".encode() * (100 + i) for i, a in enumerate(artifacts)}
    broken = {artifacts[1].name, artifacts[4].name}  # empty files of a failed sync

    def respond(index: int, request: bytes, conn: socket.socket) -> None:
        name = request.split(b" ", 2)[1].decode().lstrip("/")
        body = b"" if name in broken else datas[name]
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % len(body) + body)

    server = raw(respond)
    origin = HttpOrigin(server.url, retries=1, timeout=5.0, backoff_base=0.001)
    _opened.append(origin)
    outcomes = {}
    for artifact in artifacts:
        try:
            origin.fetch_into(artifact, io.BytesIO())
            outcomes[artifact.name] = "served"
        except IntegrityError:
            outcomes[artifact.name] = "integrity"
        except OriginError as exc:
            outcomes[artifact.name] = f"origin: {exc}"
    assert outcomes == {a.name: "integrity" if a.name in broken else "served"
                        for a in artifacts}
    assert len(server.requests) == len(artifacts) + len(broken)  # one retry each
