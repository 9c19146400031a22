"""The wire side of :class:`~distcache.testing.LoopbackOrigin`: the request handler,
the threaded server, a bandwidth cap shared by every connection, and bodies sent
with ``Transfer-Encoding: chunked`` (no ``Content-Length``, as many CDNs answer).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

logger = logging.getLogger(__name__)

#: Bytes per write of a body.
CHUNK = 64 * 1024


class Owner(Protocol):
    """What the handler needs from the origin that owns the server."""

    def stats(self) -> dict[str, Any]: ...

    def reset(self) -> None: ...

    def _track(self, conn: socket.socket, *, add: bool) -> None: ...

    def _serve(self, h: Handler) -> None: ...


class Bandwidth:
    """An aggregate rate cap shared by every connection.

    Each chunk reserves the next free interval on one virtual clock and is sent
    when its interval ends, so N concurrent downloads share the rate instead of
    each getting it.
    """

    def __init__(self, bytes_per_second: float, stopping: threading.Event) -> None:
        self._rate = float(bytes_per_second)
        self._stopping = stopping
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def wait(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now)
            self._next = start + nbytes / self._rate
            until = self._next
        delay = until - time.monotonic()
        if delay > 0:
            self._stopping.wait(delay)


def normalise(raw_path: str) -> str:
    return re.sub(r"/{2,}", "/", unquote(urlsplit(raw_path).path)).lstrip("/")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body leave in separate writes; with Nagle on, each response then
    # waits for the client's delayed ACK (~40 ms on loopback) and every count per
    # second measured against this server would be about that latency.
    disable_nagle_algorithm = True
    server: Server

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.server.owner._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("loopback origin: " + format, *args)

    def do_GET(self) -> None:
        try:
            if urlsplit(self.path).path == "/_stats":
                self.send_body(200, json.dumps(self.server.owner.stats()).encode())
            else:
                self.server.owner._serve(self)
        except OSError:
            # The client went away (timeout, retry): nothing to answer.
            self.close_connection = True

    def do_POST(self) -> None:
        raw_length = (self.headers.get("Content-Length") or "0").strip()
        if not raw_length.isascii() or not raw_length.isdigit() or int(raw_length) > 1 << 20:
            self.send_body(400, b"bad Content-Length\n")
            self.close_connection = True
            return
        if int(raw_length):
            self.rfile.read(int(raw_length))
        if urlsplit(self.path).path == "/_reset":
            self.server.owner.reset()
            self.send_body(200, b'{"reset": true}')
        else:
            self.send_body(404, b"not found\n")

    def send_head(self, status: int, length: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("Content-Type", "application/octet-stream")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()

    def send_body(
        self, status: int, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        self.send_head(status, len(body), headers)
        self.wfile.write(body)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default backlog of 5 drops the connects of a burst of ranks,
    # which then retry after ~1 s and distort every count-per-second figure.
    request_queue_size = 256
    owner: Owner

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("loopback origin: error handling %s", client_address, exc_info=True)


def shutdown_all(server: Server, stopping: threading.Event, conns: set[socket.socket],
                 pid: int) -> None:
    """Stop ``server`` and cut its connections, in the process ``pid`` that serves.
    A forked child holds copies of the sockets and no serving thread: it closes its
    copies only (``shutdown`` would wait for a loop that does not run there, and
    cutting a connection would cut the parent's too)."""
    if os.getpid() != pid:
        for conn in list(conns):
            with contextlib.suppress(OSError):
                conn.close()
        server.server_close()
        return
    stopping.set()
    server.shutdown()
    for conn in list(conns):
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
    server.server_close()



def send_chunked(h: Handler, pieces: Iterable[bytes], bandwidth: Bandwidth | None,
                 stopping: threading.Event, sent: Any) -> None:
    """Answer 200 with ``pieces`` as a chunked body (no ``Content-Length``), each piece
    paced by ``bandwidth``; ``sent(n)`` counts the bytes. Stops early on ``stopping``."""
    h.send_response(200)
    h.send_header("Transfer-Encoding", "chunked")
    h.send_header("Content-Type", "application/octet-stream")
    h.end_headers()
    for piece in pieces:
        if not piece:
            continue
        if bandwidth is not None:
            bandwidth.wait(len(piece))
        if stopping.is_set():
            h.close_connection = True
            return
        h.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        sent(len(piece))
    h.wfile.write(b"0\r\n\r\n")


def pieces_of(data: bytes) -> Iterable[bytes]:
    """``data`` in :data:`CHUNK`-sized pieces."""
    view = memoryview(data)
    return (bytes(view[i:i + CHUNK]) for i in range(0, len(view), CHUNK))


def endless() -> Iterable[bytes]:
    """A body that never ends."""
    return itertools.repeat(b"\xa5" * CHUNK)
