"""A deadline for one whole HTTP attempt, kept by a thread beside the one reading.

The origin's ``timeout`` bounds each socket read, and the minimum rate of
:mod:`distcache.origins._response` is judged between the pieces of a body. Neither
bounds what happens inside one read call of the HTTP stack: headers sent a byte at a
time (http.client accepts 100 lines of 64 KiB each), a chunk-size line that never
ends, or trailer lines after the last chunk that never stop. :class:`Watchdog` gives
each attempt a deadline (``DEADLINE_FACTOR`` times the timeout for every response's
headers; that plus the body's size at the minimum rate for the body, and the minimum
rate over each window of the body, judged from outside). When it is missed, the
attempt's socket is shut down, which ends any read, and the attempt becomes a
:class:`~distcache.origins._response.Retry` saying what the watchdog saw.

One thread per process watches every attempt in flight (:class:`_Watcher`, started
with the first and idle while none is): an attempt costs a registration, not a thread.

The socket is found through the connection pool: :class:`WatchedAdapter` makes pools
that tell the attempt of the calling thread which connection it took, and forget it
when the connection goes back to the pool (another attempt's then). Their connections
read past interim responses (``103 Early Hints``) to the final one.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import urllib3
from requests.adapters import HTTPAdapter

if TYPE_CHECKING:
    from urllib3._base_connection import BaseHTTPConnection

# `timeout` bounds each socket read, so a server that drips a byte at a time could hold
# an attempt forever. A body must keep this rate over every window of `timeout`
# seconds (at least MIN_WINDOW); below it the attempt is abandoned and retried like a
# cut body. A window, not the whole body: a healthy body of unknown size (an artifact
# from checksums.txt has no size) at 1 MiB/s must not be judged against a budget
# computed for an unknown length.
MIN_RATE_BPS = 64 * 1024
MIN_WINDOW = 2.0
#: Seconds a response's headers may take, in multiples of the timeout (connect, send
#: and first byte each take up to one; a timeout under MIN_WINDOW counts as that);
#: the body gets as long again, plus its size at the minimum rate.
DEADLINE_FACTOR = 4

_local = threading.local()


class Stalled(Exception):
    """The body arrived slower than the minimum rate over a whole window."""

    def __init__(self, nbytes: int, seconds: float) -> None:
        super().__init__(nbytes, seconds)
        self.nbytes = nbytes
        self.seconds = seconds


class Window:
    """Bytes received over the last ``seconds`` (at least): a few samples, at most one
    per eighth of the window, so a fast body costs nothing to watch."""

    def __init__(self, seconds: float, now: float) -> None:
        self.seconds = seconds
        self.start = now
        self._samples: deque[tuple[float, int]] = deque([(now, 0)])

    def check(self, now: float, total: int) -> None:
        """Raise :class:`Stalled` when, a window after the start, the bytes since the
        oldest sample still inside the window (plus one before it) are below the
        minimum rate.

        Raises:
            Stalled: slower than ``MIN_RATE_BPS`` over the window.
        """
        if now - self._samples[-1][0] >= self.seconds / 8:
            self._samples.append((now, total))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.seconds:
            self._samples.popleft()
        since, base = self._samples[0]
        span = now - since
        if now - self.start >= self.seconds and total - base < MIN_RATE_BPS * span:
            raise Stalled(total - base, span)


class Watchdog:
    """The deadline of one attempt, kept by a thread of its own that ends with it.

    Use as a context manager around the attempt, in the thread that makes it; call
    :meth:`reading` once the body is about to be read. On exit after the watchdog
    fired, the attempt raises ``timed_out(what it saw)`` in place of what it returned
    or raised (one of ``replaces``) as a consequence of the shutdown.
    """

    def __init__(self, timeout: float, written: list[int],
                 timed_out: Callable[[str], BaseException],
                 replaces: tuple[type[BaseException], ...]) -> None:
        self._timeout = timeout
        self._timed_out = timed_out
        self._replaces = replaces
        self._written = written
        self._lock = threading.Lock()
        self._conn: BaseHTTPConnection | None = None
        self._budget = DEADLINE_FACTOR * max(timeout, MIN_WINDOW)
        self._since = time.monotonic()
        self._deadline = self._since + self._budget
        self._size: int | None = None
        # The body's rate, judged over twice the window read_response uses between
        # pieces (which notices a slow body first, and says it better).
        self._window_seconds = 2 * max(timeout, MIN_WINDOW)
        self._window: Window | None = None
        #: How often the watcher looks at this attempt.
        self.tick = self._window_seconds / 8
        #: What the watchdog saw when it shut the attempt down; None until then.
        self.fired: str | None = None

    def __enter__(self) -> Watchdog:
        _local.watchdog = self
        _WATCHER.add(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _local.watchdog = None
        _WATCHER.remove(self)
        with self._lock:
            fired, self._conn = self.fired, None
        if fired is not None and (exc is None or isinstance(exc, self._replaces)):
            raise self._timed_out(f"attempt timed out: {fired}") from None

    # -- called in the attempt's thread ---------------------------------------------

    def connection(self, conn: BaseHTTPConnection) -> None:
        """A request goes out on ``conn``: its response's headers get a fresh budget."""
        with self._lock:
            self._conn = conn
            self._since = time.monotonic()
            self._deadline = self._since + self._budget
            self._window = self._size = None

    def released(self, conn: BaseHTTPConnection | None) -> None:
        """``conn`` went back to the pool: it is not this attempt's to shut down."""
        with self._lock:
            if conn is self._conn:
                self._conn = None

    def reading(self, size: int) -> None:
        """The body (``size`` bytes at most) is read from now on."""
        now = time.monotonic()
        with self._lock:
            self._since, self._size = now, size
            self._deadline = now + self._budget + size / MIN_RATE_BPS
            self._window = Window(self._window_seconds, now)

    # -- called by the watching thread -------------------------------------------------

    def look(self, now: float) -> float:
        """Judge the attempt at ``now`` (shut its socket down once it missed its
        deadline or rate); the time of the next look it needs."""
        with self._lock:
            # Once fired, a connection the attempt still takes is shut down too.
            self.fired = self.fired or self._missed(now)
            if self.fired is not None:
                _shutdown(self._conn)
                return now + self.tick
            return min(now + self.tick, max(now, self._deadline))

    def _missed(self, now: float) -> str | None:
        """What was missed at ``now``, or None (called with the lock held)."""
        elapsed = now - self._since
        if self._size is None:
            if now < self._deadline:
                return None
            return (f"no complete response headers {elapsed:.1f} s after the request "
                    f"(at most {self._budget:g} s, {DEADLINE_FACTOR} times the timeout of "
                    f"{self._timeout:g} s or {MIN_WINDOW:g} s); the server sends them "
                    "too slowly")
        written = self._written[0]
        if now >= self._deadline:
            limit = self._deadline - self._since
            if written >= self._size:
                return (f"all {written} bytes of the body came, but the response did not "
                        f"end {elapsed:.1f} s after its headers (at most {limit:.0f} s): "
                        "endless chunk framing or trailers")
            return (f"the body was not complete {elapsed:.1f} s after its headers: "
                    f"{written} bytes of at most {self._size} (at most {limit:.0f} s)")
        assert self._window is not None
        try:
            self._window.check(now, written)
        except Stalled as stalled:
            return (f"the body stalled: {stalled.nbytes} bytes in the last "
                    f"{stalled.seconds:.1f} s, {written} in all (slower than "
                    f"{MIN_RATE_BPS // 1024} KiB/s), the server may be sending "
                    "chunk framing or trailers without data")
        return None


class _Watcher:
    """The process's one watching thread: it looks at each attempt in flight when that
    attempt asks (:meth:`Watchdog.look`), and waits without a timeout while none is.
    Started with the first attempt, again in a child made by ``fork`` (which has no
    threads but the forking one)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No thread yet (a new process's state)."""
        self._cond = threading.Condition(threading.Lock())
        self._due: dict[Watchdog, float] = {}
        self._wake: float | None = None  # when the thread wakes next (None: idle)
        self._pid = -1

    def add(self, dog: Watchdog) -> None:
        with self._cond:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._due = {}
                threading.Thread(target=self._run, name="distcache-http-watchdog",
                                 daemon=True).start()
            due = self._due[dog] = time.monotonic() + dog.tick
            if self._wake is None or due < self._wake:  # else it wakes in time anyway
                self._cond.notify()

    def remove(self, dog: Watchdog) -> None:
        with self._cond:
            self._due.pop(dog, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due:
                    self._wake = None
                    self._cond.wait()
                self._wake = min(self._due.values())
                wait = self._wake - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                now = time.monotonic()
                due = [dog for dog, when in self._due.items() if when <= now]
            for dog in due:  # outside the watcher's lock: a look takes the attempt's
                later = dog.look(now)
                with self._cond:
                    if dog in self._due:
                        self._due[dog] = later


_WATCHER = _Watcher()
# A child made by fork has no watching thread, and its lock may have been held.
os.register_at_fork(after_in_child=_WATCHER.reset)


def _shutdown(conn: BaseHTTPConnection | None) -> None:
    """Shut down ``conn``'s socket, which ends a read blocked on it (or about to be)."""
    sock: Any = getattr(conn, "sock", None)
    while sock is not None and not isinstance(sock, socket.socket):
        sock = getattr(sock, "socket", None)  # urllib3's TLS-in-TLS transport
    if sock is not None:
        # socket.socket's own shutdown: an SSLSocket's would also drop its TLS state
        # under the thread that is reading with it. Closed meanwhile: nothing to end.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Watched(urllib3.HTTPConnectionPool):
    """Tells the calling thread's :class:`Watchdog` which connection it uses."""

    def _get_conn(self, timeout: float | None = None) -> BaseHTTPConnection:
        conn = super()._get_conn(timeout)
        watchdog: Watchdog | None = getattr(_local, "watchdog", None)
        if watchdog is not None:
            watchdog.connection(conn)
        return conn

    def _put_conn(self, conn: BaseHTTPConnection | None) -> None:
        watchdog: Watchdog | None = getattr(_local, "watchdog", None)
        if watchdog is not None:
            watchdog.released(conn)
        super()._put_conn(conn)


#: Interim responses a response may open with; one more ends the attempt.
MAX_INTERIM = 20


class _FinalResponse(http.client.HTTPResponse):
    """A response read past its interim (1xx) responses, 101 Switching Protocols
    excepted, to the final one. http.client passes over only ``100 Continue``: it
    would take a ``103 Early Hints`` for the answer and leave the final one unread."""

    _interim = 0

    def _read_status(self) -> tuple[str, int, str]:
        version, status, reason = super()._read_status()  # type: ignore[misc]
        if 100 <= status < 200 and status != 101:
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise http.client.HTTPException(
                    f"more than {MAX_INTERIM} interim (1xx) responses")
            # begin() reads on past a 100 Continue, its headers skipped: past this too.
            return version, http.client.CONTINUE, reason
        return version, status, reason


def _final(cls: type) -> type:
    """Connection class ``cls`` reading each response with :class:`_FinalResponse`."""
    if not issubclass(cls, http.client.HTTPConnection):
        return cls  # urllib3's stand-in where ssl is missing: it never connects
    return type(f"Final{cls.__name__}", (cls,), {"response_class": _FinalResponse})


_WATCHED: dict[type, type] = {}
_WATCHED_LOCK = threading.Lock()


def _watched(cls: type[urllib3.HTTPConnectionPool]) -> type[urllib3.HTTPConnectionPool]:
    if issubclass(cls, _Watched):
        return cls
    with _WATCHED_LOCK:
        made = _WATCHED.get(cls)
        if made is None:
            made = _WATCHED[cls] = type(f"Watched{cls.__name__}", (_Watched, cls),
                                        {"ConnectionCls": _final(cls.ConnectionCls)})
        return made


def _watch_pools(manager: Any) -> Any:
    classes = getattr(manager, "pool_classes_by_scheme", None)
    if isinstance(classes, dict):
        manager.pool_classes_by_scheme = {scheme: _watched(cls)
                                          for scheme, cls in classes.items()}
    return manager


class WatchedAdapter(HTTPAdapter):
    """An adapter whose pools (direct or through a proxy) report their connections to
    the calling thread's :class:`Watchdog`."""

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        _watch_pools(self.poolmanager)

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: Any) -> Any:
        known = proxy in self.proxy_manager
        manager = super().proxy_manager_for(proxy, **proxy_kwargs)
        return manager if known else _watch_pools(manager)
