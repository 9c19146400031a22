"""A download stopped (an init that failed or was interrupted, a closed start-up)
while its origin backs off (429 with Retry-After, a 5xx) sends no request after the
back-off: the retry ends there, instead of asking a rate-limiting origin again from a
thread whose init has already returned."""

from __future__ import annotations

import io
import socket
import threading
from collections.abc import Callable
from typing import Any

from distcache.artifact import Artifact, sha256_hex
from distcache.origins import HttpOrigin, Interrupted, Stopper
from tests.support.origins import Responder, ThreadedRawServer, closing_fixture, servers_fixture

raw = servers_fixture(ThreadedRawServer)
_opened: list[Any] = []
_close_origins = closing_fixture(_opened)


def _busy(index: int, request: bytes, conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 5\r\n"
                 b"Content-Length: 0\r\nConnection: close\r\n\r\n")


def test_a_download_stopped_during_its_back_off_asks_nothing_more(
        raw: Callable[[Responder], ThreadedRawServer]) -> None:
    server = raw(_busy)
    backing_off, released = threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:  # the back-off, held until the stop
        backing_off.set()
        released.wait(30)

    origin = HttpOrigin(server.url, retries=3, timeout=5.0, sleep=sleep)
    _opened.append(origin)
    stopper = Stopper(origin)
    data = b"x" * 100
    outcome: list[BaseException | int] = []

    def download() -> None:
        try:
            outcome.append(stopper.origin.fetch_into(Artifact("a.cubin", sha256_hex(data)),
                                                     io.BytesIO()))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=download, daemon=True)
    thread.start()
    assert backing_off.wait(30)
    stopper.stop()
    released.set()
    thread.join(30)
    assert not thread.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], Interrupted), outcome
    assert len(server.requests) == 1, len(server.requests)
