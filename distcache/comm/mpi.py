"""The mpi4py backend.

Every collective is started non-blocking (``Ibcast``, ``Iallgatherv``, ``Ibarrier``)
and polled with ``Test()`` until a deadline, so a rank that never arrives makes its
peers raise :class:`~distcache.errors.CollectiveTimeout` instead of hanging in a
blocking MPI call. MPI cannot cancel a started collective, so a communicator whose
collective timed out refuses further calls (a later call would be matched against
the abandoned one); build a new communicator to continue.

mpi4py is imported in the constructor, never at module import: importing
``mpi4py.MPI`` calls ``MPI_Init``.
"""

from __future__ import annotations

import logging
import pickle
import time
from array import array
from typing import Any

from distcache.comm.base import MAX_MESSAGE_BYTES, Communicator, chunk_spans, hostname
from distcache.config import settings
from distcache.errors import CollectiveTimeout, CommError

__all__ = ["MpiCommunicator"]

log = logging.getLogger(__name__)

# Polling: start with a tight loop (small collectives finish in microseconds), back
# off to a short sleep so idle ranks do not steal cores from working ones.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 2e-3


def _check_chunk(chunk_bytes: int) -> int:
    if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(
            f"chunk_bytes must be between 1 and {MAX_MESSAGE_BYTES} (2 GiB - 1), got {chunk_bytes}"
        )
    return chunk_bytes


class MpiCommunicator:
    """A :class:`~distcache.comm.base.Communicator` over an mpi4py communicator.

    Args:
        mpi_comm: an ``mpi4py.MPI.Comm`` (default ``COMM_WORLD``).
        timeout: default seconds per collective (default ``DISTCACHE_TIMEOUT``).
        chunk_bytes: largest single broadcast message (default ``DISTCACHE_CHUNK_BYTES``).
        node_id: this rank's node identity (default ``DISTCACHE_NODE_ID``, else the
            hostname).

    Raises:
        CommError: mpi4py cannot be imported or initialised.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
        ValueError: ``chunk_bytes`` is out of range.
    """

    def __init__(
        self,
        mpi_comm: Any = None,
        *,
        timeout: float | None = None,
        chunk_bytes: int | None = None,
        node_id: str | None = None,
    ) -> None:
        try:
            from mpi4py import MPI
        except Exception as exc:  # ImportError, or a broken MPI library at init
            raise CommError(
                f"mpi4py is not usable: {exc}; install mpi4py and an MPI library "
                "(pip install 'distcache[mpi]')",
                op="init",
                backend="mpi",
            ) from exc
        self._MPI = MPI
        conf = settings(timeout=timeout, chunk_bytes=chunk_bytes, node_id=node_id)
        self._comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not conf.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {conf.timeout}")
        self._timeout = conf.timeout
        self._chunk_bytes = _check_chunk(conf.chunk_bytes)
        self._node_id = conf.node_id if conf.node_id is not None else hostname()
        try:
            self._rank = int(self._comm.Get_rank())
            self._size = int(self._comm.Get_size())
        except MPI.Exception as exc:
            raise CommError(
                f"cannot query the MPI communicator: {exc}", op="init", backend="mpi"
            ) from exc
        self._broken: str | None = None
        # Requests abandoned by a timed-out collective; kept alive so that MPI never
        # writes into a buffer Python has already freed.
        self._abandoned: list[tuple[Any, Any]] = []
        # split() results by the all-gathered colors (see split).
        self._children: dict[tuple[int, ...], MpiCommunicator] = {}
        #: Payload chunk messages this rank took part in (one per ``Ibcast`` of data).
        self.chunk_messages = 0
        #: Payload bytes this rank sent or received through ``broadcast_bytes``.
        self.payload_bytes = 0

    # -- identity ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def backend(self) -> str:
        return "mpi"

    @property
    def mpi_comm(self) -> Any:
        """The wrapped ``mpi4py.MPI.Comm``."""
        return self._comm

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def chunk_bytes(self) -> int:
        return self._chunk_bytes

    def __repr__(self) -> str:
        return f"MpiCommunicator(rank={self._rank}, size={self._size}, node_id={self._node_id!r})"

    # -- plumbing ---------------------------------------------------------------------

    def _deadline(self, timeout: float | None) -> tuple[float, float]:
        if self._broken is not None:
            raise CommError(
                f"rank {self._rank}/{self._size}: this MPI communicator is unusable after "
                f"{self._broken}; create a new communicator",
                op="reuse",
                rank=self._rank,
                backend="mpi",
            )
        wait = self._timeout if timeout is None else timeout
        return wait, time.monotonic() + wait

    def _wait(self, request: Any, op: str, wait: float, deadline: float, keep: Any) -> None:
        """Poll ``request`` until it completes or ``deadline`` passes."""
        pause = _POLL_MIN_S
        try:
            while not request.Test():
                if time.monotonic() >= deadline:
                    self._broken = f"{op} timed out after {wait:g} s"
                    self._abandoned.append((request, keep))
                    raise CollectiveTimeout(
                        f"{op} on rank {self._rank}/{self._size} ({self._node_id}) did not "
                        f"complete within {wait:g} s: a peer rank never arrived; check for "
                        "a crashed or stalled rank, or raise DISTCACHE_TIMEOUT",
                        op=op,
                        timeout=wait,
                        rank=self._rank,
                        backend="mpi",
                    )
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
        except self._MPI.Exception as exc:
            raise self._comm_error(op, exc) from exc

    def _comm_error(self, op: str, exc: BaseException) -> CommError:
        return CommError(
            f"{op} failed on rank {self._rank}/{self._size} ({self._node_id}): {exc}",
            op=op,
            rank=self._rank,
            backend="mpi",
        )

    def _start(self, op: str, start: Any, *args: Any) -> Any:
        try:
            return start(*args)
        except self._MPI.Exception as exc:
            raise self._comm_error(op, exc) from exc

    # -- collectives ------------------------------------------------------------------

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} is out of range for a communicator of size {self._size}")
        if self._rank == root and data is None:
            raise ValueError("broadcast_bytes: the root rank must pass data")
        wait, deadline = self._deadline(timeout)
        MPI = self._MPI
        header = array("q", [len(data) if self._rank == root and data is not None else 0])
        request = self._start("broadcast_bytes", self._comm.Ibcast, [header, MPI.INT64_T], root)
        self._wait(request, "broadcast_bytes", wait, deadline, header)
        total = header[0]
        # The root broadcasts from a private copy: MPI may need a writable buffer, and
        # the caller's object must not change under an abandoned request.
        buf = bytearray(data) if self._rank == root and data is not None else bytearray(total)
        view = memoryview(buf)
        for start, stop in chunk_spans(total, self._chunk_bytes):
            request = self._start(
                "broadcast_bytes", self._comm.Ibcast, [view[start:stop], MPI.BYTE], root
            )
            self._wait(request, "broadcast_bytes", wait, deadline, buf)
            self.chunk_messages += 1
        self.payload_bytes += total
        return data if self._rank == root and isinstance(data, bytes) else bytes(buf)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        wait, deadline = self._deadline(timeout)
        MPI = self._MPI
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = array("q", [0] * self._size)
        request = self._start(
            "allgather_object",
            self._comm.Iallgather,
            [array("q", [len(mine)]), MPI.INT64_T],
            [sizes, MPI.INT64_T],
        )
        self._wait(request, "allgather_object", wait, deadline, sizes)
        total = sum(sizes)
        if total > MAX_MESSAGE_BYTES:
            raise CommError(
                f"allgather_object: {total} pickled bytes over all ranks exceed one MPI "
                f"message ({MAX_MESSAGE_BYTES}); all-gather small objects only",
                op="allgather_object",
                rank=self._rank,
                backend="mpi",
            )
        displs = [0] * self._size
        for i in range(1, self._size):
            displs[i] = displs[i - 1] + sizes[i - 1]
        out = bytearray(total)
        send = bytearray(mine)
        request = self._start(
            "allgather_object",
            self._comm.Iallgatherv,
            [send, MPI.BYTE],
            [out, (list(sizes), displs), MPI.BYTE],
        )
        self._wait(request, "allgather_object", wait, deadline, (send, out))
        view = memoryview(out)
        return [
            pickle.loads(view[displs[i] : displs[i] + sizes[i]]) for i in range(self._size)
        ]

    def barrier(self, *, timeout: float | None = None) -> None:
        wait, deadline = self._deadline(timeout)
        request = self._start("barrier", self._comm.Ibarrier)
        self._wait(request, "barrier", wait, deadline, None)

    def split(self, color: int) -> Communicator:
        # MPI_Comm_split blocks with no timeout; an all-gather first proves every rank
        # has arrived (or raises CollectiveTimeout), and lets any int be a color (MPI
        # wants non-negative ones).
        #
        # The child for a partition is kept and handed out again: the collective splits
        # off the same writers on every prefetch and sync, and a communicator per call
        # would pile up for the life of the job (MPICH allows about 2,000). Whether any
        # rank's kept child broke travels in the same all-gather, so every rank drops
        # its children together and no rank enters Split alone.
        broken = any(c._broken is not None for c in self._children.values())
        gathered = self.allgather_object((int(color), broken))
        if any(b for _, b in gathered):
            self._children.clear()
        colors = tuple(c for c, _ in gathered)
        kept = self._children.get(colors)
        if kept is not None:
            return kept
        mpi_color = sorted(set(colors)).index(int(color))
        try:
            child = self._comm.Split(mpi_color, self._rank)
        except self._MPI.Exception as exc:
            raise self._comm_error("split", exc) from exc
        made = MpiCommunicator(
            child, timeout=self._timeout, chunk_bytes=self._chunk_bytes, node_id=self._node_id
        )
        self._children[colors] = made
        return made
