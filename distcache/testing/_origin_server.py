"""A real HTTP origin on loopback, with faults on demand.

:class:`LoopbackOrigin` serves the files under a directory the way a CDN serves
FlashInfer's cubin repository, counts every artifact request, and misbehaves when told
to (server errors, rate limiting, truncated or wrong bodies, bodies without a
length or without an end, hangs, redirects), so origin and prefetch tests run against
real sockets without leaving the machine. It records the headers of every artifact
request (a test asserts that a host never saw an ``Authorization`` header). Other
processes (MPI ranks) read the counters with ``GET /_stats`` and clear them with
``POST /_reset``.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from distcache.artifact import path_under
from distcache.errors import ArtifactNameError
from distcache.testing._loopback_wire import (
    CHUNK,
    Bandwidth,
    Handler,
    Server,
    endless,
    normalise,
    pieces_of,
    send_chunked,
    shutdown_all,
)

#: Faults :meth:`LoopbackOrigin.inject` accepts, with their parameters.
FAULTS: dict[str, str] = {
    "500": "answer 500 Internal Server Error",
    "429": "answer 429 Too Many Requests with Retry-After: retry_after (default 1)",
    "404": "answer 404 Not Found although the file exists",
    "truncate": "send the full Content-Length, then fraction (default 0.5) of the body, then close",
    "wrong_bytes": "send a body of the right length with one byte changed",
    "hang": "accept and never answer, for seconds (default 30) or until stop()",
    "latency": "wait seconds (default 1.0) before answering normally",
    "redirect": "answer status (default 302) with Location: location, or base + '/' + path",
    "chunked": "send the file with Transfer-Encoding: chunked and no Content-Length",
    "endless": "send a chunked body that never ends, until the client hangs up or stop()",
}

#: Headers kept for :attr:`LoopbackOrigin.request_headers` (the latest requests).
_HEADERS_KEPT = 4096


@dataclass
class _Fault:
    kind: str
    path: str | None
    remaining: int | None
    params: dict[str, Any] = field(default_factory=dict)



class LoopbackOrigin:
    """An HTTP server on loopback serving the files under ``root``.

    Starts serving in a daemon thread on construction; use it as a context manager
    or call :meth:`stop`. ``latency`` (seconds) delays every artifact answer;
    ``bandwidth`` (bytes per second) caps the total rate across all connections.
    Paths that leave ``root`` (``..``, symlinks pointing outside) are answered 404.

    Counters cover artifact GETs only (not ``/_stats`` or ``/_reset``); paths are
    counted by the artifact name they ask for, without the leading ``/``.

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``latency`` < 0 or ``bandwidth`` <= 0.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency}")
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
        self.root = Path(root).resolve()
        self.latency = latency
        self._stopping = threading.Event()
        self._bandwidth = Bandwidth(bandwidth, self._stopping) if bandwidth else None
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._bytes_sent = 0
        self._faults: list[_Fault] = []
        self._headers: deque[dict[str, str]] = deque(maxlen=_HEADERS_KEPT)
        self._conns: set[socket.socket] = set()
        self._server = Server((host, port), Handler)
        self._server.owner = self
        address = self._server.server_address
        self.host: str = str(address[0])
        self.port: int = int(address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"loopback-origin-{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._finalizer = weakref.finalize(
            self, shutdown_all, self._server, self._stopping, self._conns, os.getpid()
        )

    # -- lifetime ---------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        """Stop serving and close every open connection (idempotent). Handlers that
        hang or throttle are woken, so this returns promptly."""
        self._finalizer()
        self._thread.join(timeout=5)

    def __enter__(self) -> LoopbackOrigin:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LoopbackOrigin({self.url}, root={str(self.root)!r})"

    # -- counters and faults ----------------------------------------------------

    @property
    def total_requests(self) -> int:
        with self._lock:
            return sum(self._requests.values())

    @property
    def requests(self) -> Counter[str]:
        """A copy of the per-path request counts."""
        with self._lock:
            return Counter(self._requests)

    @property
    def bytes_sent(self) -> int:
        with self._lock:
            return self._bytes_sent

    @property
    def last_headers(self) -> dict[str, str]:
        """The headers (lower-case names) of the latest artifact GET."""
        with self._lock:
            return dict(self._headers[-1]) if self._headers else {}

    @property
    def request_headers(self) -> list[dict[str, str]]:
        """The headers (lower-case names) of every artifact GET since the last
        :meth:`reset`, oldest first (the latest 4096)."""
        with self._lock:
            return [dict(h) for h in self._headers]

    def stats(self) -> dict[str, Any]:
        """The counters as ``GET /_stats`` returns them."""
        with self._lock:
            return {
                "total_requests": sum(self._requests.values()),
                "requests": dict(self._requests),
                "bytes_sent": self._bytes_sent,
            }

    def reset(self) -> None:
        """Clear the counters and every pending fault."""
        with self._lock:
            self._requests.clear()
            self._bytes_sent = 0
            self._faults.clear()
            self._headers.clear()

    def inject(
        self, fault: str, path: str | None = None, count: int | None = 1, **params: Any
    ) -> None:
        """Make the next ``count`` artifact GETs (of ``path`` only, when given)
        misbehave; ``count=None`` means every one until :meth:`reset`. Faults
        apply in the order injected. See :data:`FAULTS` for kinds and parameters.

        Raises:
            ValueError: an unknown fault or a count < 1.
        """
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {sorted(FAULTS)}")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1 or None, got {count}")
        if fault == "redirect" and "location" not in params and "base" not in params:
            raise ValueError("the redirect fault needs location=URL or base=URL")
        target = normalise(path) if path is not None else None
        with self._lock:
            self._faults.append(_Fault(fault, target, count, dict(params)))

    def _take_fault(self, name: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.path is None or fault.path == name:
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining == 0:
                            self._faults.remove(fault)
                    return fault
        return None

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def _sent(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_sent += nbytes

    # -- serving ----------------------------------------------------------------

    def _resolve(self, name: str) -> Path | None:
        try:
            path = path_under(self.root, name)
        except ArtifactNameError:
            return None
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        if not real.is_relative_to(self.root) or not real.is_file():
            return None
        return real

    def _serve(self, h: Handler) -> None:
        name = normalise(h.path)
        with self._lock:
            self._requests[name] += 1
            self._headers.append({k.lower(): v for k, v in h.headers.items()})
        fault = self._take_fault(name)
        if self.latency:
            self._stopping.wait(self.latency)
        kind = fault.kind if fault else None
        params = fault.params if fault else {}
        if kind == "hang":
            self._stopping.wait(float(params.get("seconds", 30.0)))
            h.close_connection = True
            return
        if kind == "latency":
            self._stopping.wait(float(params.get("seconds", 1.0)))
        if kind == "500":
            h.send_body(500, b"injected server error\n")
            return
        if kind == "429":
            retry_after = str(params.get("retry_after", 1))
            h.send_body(429, b"slow down\n", {"Retry-After": retry_after})
            return
        if kind == "404":
            h.send_body(404, b"not found\n")
            return
        if kind == "redirect":
            location = params.get("location") or f"{str(params['base']).rstrip('/')}/{quote(name)}"
            h.send_body(int(params.get("status", 302)), b"", {"Location": str(location)})
            return
        if kind == "endless":
            send_chunked(h, endless(), self._bandwidth, self._stopping, self._sent)
            return
        path = self._resolve(name)
        if path is None:
            h.send_body(404, b"not found\n")
            return
        data = path.read_bytes()
        if kind == "wrong_bytes" and data:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        if kind == "chunked":
            send_chunked(h, pieces_of(data), self._bandwidth, self._stopping, self._sent)
            return
        h.send_head(200, len(data))
        if kind == "truncate":
            data = data[: int(len(data) * float(params.get("fraction", 0.5)))]
            h.close_connection = True
        view = memoryview(data)
        for offset in range(0, len(view), CHUNK):
            chunk = view[offset : offset + CHUNK]
            if self._bandwidth is not None:
                self._bandwidth.wait(len(chunk))
            if self._stopping.is_set():
                h.close_connection = True
                return
            h.wfile.write(chunk)
            self._sent(len(chunk))
