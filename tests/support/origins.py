"""What the HTTP origin tests share: a raw server answering each connection with a
function, starting servers for a test and closing them, and closing every origin a
test opened (pooled connections left to the garbage
collector are ResourceWarnings, which the suite treats as errors)."""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Protocol, TypeVar

import pytest

from distcache.artifact import Artifact
from distcache.origins import BaseOrigin, Interrupted


class Closing(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=Closing)


def started(make: Callable[[Any], S]) -> Iterator[Callable[[Any], S]]:
    """A fixture's body: a function starting ``make(respond)`` servers, each closed when
    the test ends."""
    servers: list[S] = []

    def start(respond: Any) -> S:
        servers.append(make(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def servers_fixture(make: Callable[[Any], Closing]) -> object:
    """A fixture for a test module to bind to a name (``raw = servers_fixture(Server)``):
    its value is :func:`started`'s, a function starting ``make(respond)`` servers."""

    @pytest.fixture
    def servers() -> Iterator[Callable[[Any], Closing]]:
        yield from started(make)

    return servers


def close_all(opened: list[Any]) -> None:
    """Close every origin in ``opened`` (emptying it), then collect what a refused
    response left to the garbage collector (urllib3 closes the socket of a response it
    refused before handing it on only then), its warning silenced here rather than
    landing in a later test."""
    while opened:
        opened.pop().close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def closing_fixture(opened: list[Any]) -> object:
    """An autouse fixture for a test module to bind to a name: after each test,
    :func:`close_all` of ``opened`` (the list the module's tests add their origins to)."""

    @pytest.fixture(autouse=True)
    def close_opened() -> Iterator[None]:
        yield
        close_all(opened)

    return close_opened


#: (index of the connection, the request's bytes up to its blank line, the connection).
Responder = Callable[[int, bytes, socket.socket], None]


def read_head(conn: socket.socket) -> bytes | None:
    """What a client sent up to the end of its request's headers (the blank line, and
    whatever came with it), or None where it hung up first."""
    head = b""
    while b"\r\n\r\n" not in head:
        got = conn.recv(65536)
        if not got:
            return None
        head += got
    return head


class ThreadedRawServer:
    """Serves each connection in its own thread with ``respond``; ``stop`` releases
    handlers that wait on it."""

    def __init__(self, respond: Responder) -> None:
        self.respond = respond
        self.requests: list[bytes] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                request = read_head(conn)
                if request is None:
                    return
                with self._lock:
                    self.requests.append(request)
                    index = len(self.requests) - 1
                self.respond(index, request, conn)
            except OSError:
                pass  # the client hung up

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._accept.join(5)
        for thread in self._threads:
            thread.join(5)
        assert not any(t.is_alive() for t in [self._accept, *self._threads])


class HeldOrigin(BaseOrigin):
    """An origin that writes the first half of :attr:`data` for each artifact, then
    waits for :attr:`go` before the rest (a download waiting on its origin, as in a
    socket read); counts its calls and records how each write of the rest ended
    (``"written"``, or ``"interrupted"`` where the download was stopped)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.started = threading.Event()
        self.go = threading.Event()
        self.finished = threading.Event()
        self.calls = 0
        self.outcomes: list[str] = []

    def describe(self) -> str:
        return "held"

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        self.calls += 1
        half = len(self.data) // 2
        out.write(self.data[:half])
        self.started.set()
        self.go.wait(60)
        try:
            out.write(self.data[half:])
            self.outcomes.append("written")
        except Interrupted:
            self.outcomes.append("interrupted")
            raise
        finally:
            self.finished.set()
        return len(self.data)
