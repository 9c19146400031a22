"""The node agent's listeners: its TCP server for the other nodes' agents, with a cap on
the connections it holds at once, and its Unix socket for this node's processes, which
only this user may connect to; and the base of their handler, which gives a request's
head a bound in total time (:class:`BoundedHead`)."""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import secrets
import socket
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

from distcache._log import get_logger
from distcache.peer._client import Cut

log = get_logger(__name__)


def private_socket(path: Path, handler: Any) -> UnixServer:
    """A server on a Unix socket at ``path`` that only this user may connect to: bound
    at a fresh name beside it, made this user's alone, then renamed over ``path``, so
    the socket is never reachable with wider permissions. (Not by setting the umask
    around the bind: the umask is the process's, and the prefetch's threads create
    the pool's directories and objects meanwhile.)"""
    # No longer than ``path``'s name, where it can: a Unix socket's path is short.
    fresh = path.with_name(f".{secrets.token_hex(8)}"[:max(len(path.name), 9)])
    server = UnixServer(str(fresh), handler, bind_and_activate=False)
    try:
        server.server_bind()
        os.chmod(fresh, 0o600)
        os.replace(fresh, path)
        placed = os.lstat(path)
        server.placed = (path, placed.st_dev, placed.st_ino)
        server.server_activate()  # listening only now: nobody connected before the chmod
    except BaseException:
        server.server_close()
        with contextlib.suppress(OSError):
            fresh.unlink()
        raise
    return server


class _Live(http.server.ThreadingHTTPServer):
    """A server that knows the connections it serves, so that :func:`close_connections`
    can shut them when the agent stops (a stopped agent serves no request more)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._live: set[socket.socket] = set()
        self._live_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._live_lock:  # on the serving thread: known before its thread starts
            self._live.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._live_lock:  # never shut by close_connections once closed here
            self._live.discard(request)
            super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A connection shut by its client or by close_connections (an OSError): not a
        # traceback on stderr; anything else is a fault of the handler, said as one.
        fault = not isinstance(sys.exc_info()[1], OSError)
        log.log(logging.WARNING if fault else logging.DEBUG,
                "peers: a connection from %s ended in an error", client_address,
                exc_info=True)


def close_connections(server: Any) -> None:
    """Shut every connection ``server`` still serves (after its ``shutdown``: no new
    one comes); their threads end at their next read or write."""
    if not isinstance(server, _Live):
        return
    with server._live_lock:
        for request in server._live:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        server._live.clear()


#: Most connections an agent's TCP listener handles at once, at least; a job's agents
#: raise it to :data:`PER_NODE` per node (every node may ask one owner for a popular
#: artifact at once). One more is closed at once: a host of the job's network that
#: opens connections and sends nothing would otherwise hold a thread each, unsigned.
MAX_CONNECTIONS = 256
PER_NODE = 4


class TcpServer(_Live):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cap = MAX_CONNECTIONS
        self.turned_away = 0
        self._open = 0
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def server_bind(self) -> None:
        # HTTPServer's would look the address's name up (reverse DNS: a stalled
        # resolver's timeouts at every start), for a name nothing here reads.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def joined(self, nodes: int) -> None:
        """The job has ``nodes`` agents: hold as many connections as they may open,
        and queue as many not yet accepted (the kernel caps it at ``somaxconn``)."""
        self.cap = max(MAX_CONNECTIONS, PER_NODE * nodes)
        if self.cap > self.request_queue_size:
            with contextlib.suppress(OSError):
                self.socket.listen(self.cap)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            admitted = self._open < self.cap
            self._open += admitted
            if not admitted:
                self.turned_away += 1
        if not admitted:
            if self.turned_away == 1:
                log.warning("peers: agent at %s: %d connections open; closing the next "
                            "ones until some end", self.server_address, self.cap)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to let it go
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._open -= 1


class UnixServer(_Live):
    daemon_threads = True
    address_family = socket.AF_UNIX
    request_queue_size = 128

    #: Where :func:`private_socket` put the socket, and its (device, inode) there.
    placed: tuple[Path, int, int] | None = None

    def server_bind(self) -> None:  # HTTPServer's would resolve the path as a host name
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = "localhost", 0

    def server_close(self) -> None:
        """Close the socket, and remove its name if that is still this socket: never a
        socket another agent (a later start on the same pool) has put there since."""
        super().server_close()
        placed, self.placed = self.placed, None
        if placed is not None:
            with contextlib.suppress(OSError):
                st = os.lstat(placed[0])
                if (st.st_dev, st.st_ino) == placed[1:]:
                    os.unlink(placed[0])


#: Seconds a connection has to send a request's head (its line and headers), from when
#: the agent starts reading it. The per-read timeout alone let a client that sends a
#: byte every few seconds hold a thread, and one of the listener's connections, for as
#: long as it kept on, unsigned; one that sends nothing is cut here too.
HEAD_S = 10.0


class BoundedHead(http.server.BaseHTTPRequestHandler):
    """A handler whose requests' heads must arrive whole within :data:`HEAD_S`: past
    it the connection is shut, and a head cut short is not handled (not even
    refused: nothing is sent back). :meth:`head_cut` is told each time."""

    _head: Cut | None = None

    def handle_one_request(self) -> None:
        bound = HEAD_S
        self._head = head = Cut(self.connection, time.monotonic() + bound)
        try:
            super().handle_one_request()
        finally:
            head.cancel()
            if head.fired:
                self.close_connection = True
                self.head_cut(bound)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        head = self._head
        if head is not None:
            head.cancel()  # the head is in: the answer has its own bounds
            if head.fired:  # what was read is a head cut short, not a request
                return False
        return parsed

    def head_cut(self, bound: float) -> None:
        """A request's head did not arrive within ``bound`` seconds."""
