"""The node agent's listeners: its TCP server for the other nodes' agents, with a cap on
the connections it holds at once, and its Unix socket for this node's processes, which
only this user may connect to; and the base of their handler, which gives a request's
head a bound in total time (:class:`BoundedHead`).

A child forked from the agent's process lets go of its copies of the listeners and of
the connections being served (:func:`_forked`): it has none of the agent's threads, so
a listener it held would take connections nobody accepts once the agent stops or its
process dies (askers would wait out their whole time where a closed port refuses them
at once), and a child that closes the agent must neither wait for a serving thread it
does not have nor remove the parent's socket."""

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
import weakref
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

    #: Set in a forked child (:meth:`forked`): no thread of this process serves it.
    orphan = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._live: set[socket.socket] = set()
        self._live_lock = threading.Lock()
        super().__init__(*args, **kwargs)
        _LISTENERS.add(self)

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait for it, where it runs in this process (in a
        forked child it does not: waiting would never end)."""
        if not self.orphan:
            super().shutdown()

    def forked(self) -> None:
        """In a forked child: close this process's copies of the listening socket and
        of the connections (never shut them: that would end the parent's too)."""
        self.orphan = True
        self._live_lock = threading.Lock()  # another thread may have held it at the fork
        with contextlib.suppress(OSError):
            self.socket.close()
        for request in list(self._live):
            with contextlib.suppress(OSError):
                request.close()
        self._live.clear()

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


#: This process's listeners, for :func:`_forked`.
_LISTENERS: weakref.WeakSet[_Live] = weakref.WeakSet()


def _forked() -> None:
    """In a child just forked (one thread, no agent serving in it): every listener
    lets go of what the parent serves with (:meth:`_Live.forked`)."""
    for server in list(_LISTENERS):
        server.forked()


os.register_at_fork(after_in_child=_forked)


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
#: One address holds at most three quarters of them (:func:`per_address`).
MAX_CONNECTIONS = 256
PER_NODE = 4


def per_address(cap: int) -> int:
    """The connections one address may hold of a listener's ``cap``: a host that fills
    its share with connections that send nothing leaves the rest to the job's other
    nodes (else every other node's connection would be closed at once, and each would
    take the agent for a busy one and ask the origin)."""
    return cap - cap // 4


class TcpServer(_Live):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.cap = MAX_CONNECTIONS
        self.turned_away = 0
        self._open = 0
        self._by_address: dict[str, int] = {}
        self._told: set[str] = set()  # the limits named at WARNING once
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
        address = str(client_address[0])
        with self._lock:
            mine = self._by_address.get(address, 0)
            full = ("all" if self._open >= self.cap else
                    "address" if mine >= per_address(self.cap) else None)
            if full is None:
                self._open += 1
                self._by_address[address] = mine + 1
            else:
                self.turned_away += 1
                first = full not in self._told
                self._told.add(full)
        if full is not None:
            if first and full == "all":
                log.warning("peers: agent at %s: %d connections open; closing the next "
                            "ones until some end", self.server_address, self.cap)
            elif first:
                log.warning("peers: agent at %s: %s holds %d of its %d connections; closing "
                            "its next ones until some end (more than the job's agents "
                            "open: if %s is no node of the job, keep it off the agents' "
                            "network)", self.server_address, address, mine, self.cap,
                            address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread to let it go
            self._release(address)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(str(client_address[0]))

    def _release(self, address: str) -> None:
        with self._lock:
            self._open -= 1
            left = self._by_address.pop(address, 1) - 1
            if left:
                self._by_address[address] = left


class UnixServer(_Live):
    daemon_threads = True
    address_family = socket.AF_UNIX
    request_queue_size = 128

    #: Where :func:`private_socket` put the socket, and its (device, inode) there.
    placed: tuple[Path, int, int] | None = None

    def forked(self) -> None:
        super().forked()
        self.placed = None  # the parent's socket: never removed by a child's close

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
