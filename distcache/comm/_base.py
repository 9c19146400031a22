"""The Communicator seam: the few collectives distcache's policy needs.

Backends (mpi4py, torch.distributed, in-process) implement :class:`Communicator`;
every policy above the seam (prefetch, the IPC registry, error agreement) is written
once against it. Every blocking call takes ``timeout`` (seconds; ``None`` means the
communicator's default) and raises :class:`~distcache.errors.CollectiveTimeout`
instead of hanging.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from distcache.errors import DistcacheError, RemoteError

#: No single message may exceed this: MPI counts are 32-bit and several transports
#: misbehave at 2**31 bytes.
MAX_MESSAGE_BYTES = (2 << 30) - 1


@runtime_checkable
class Communicator(Protocol):
    """What a collective needs from a process group, and nothing more."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def node_id(self) -> str:
        """Identity of the node this rank runs on (hostname or ``DISTCACHE_NODE_ID``)."""
        ...

    @property
    def backend(self) -> str:
        """``"mpi"``, ``"torch"``, ``"local"`` or ``"threads"``."""
        ...

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        """Return ``root``'s ``data`` on every rank (``data`` is ignored elsewhere).

        Payloads larger than the chunk size are sent in chunks.

        Raises:
            CollectiveTimeout: not every rank arrived in time.
            CommError: the backend failed.
            ValueError: ``root`` is out of range, or ``data`` is None on ``root``.
        """
        ...

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's small picklable ``obj``, in rank order.

        Raises:
            CollectiveTimeout: not every rank arrived in time.
            CommError: the backend failed.
        """
        ...

    def barrier(self, *, timeout: float | None = None) -> None:
        """Wait for every rank.

        Raises:
            CollectiveTimeout: not every rank arrived in time.
        """
        ...

    def split(self, color: int) -> Communicator:
        """A sub-communicator of the ranks that passed the same ``color`` (collective).

        Raises:
            CollectiveTimeout: not every rank arrived in time.
        """
        ...


def hostname() -> str:
    return socket.gethostname()


def check_broadcast(rank: int, size: int, root: int, data: bytes | bytearray | None) -> None:
    """The argument checks every ``broadcast_bytes`` makes before it communicates.

    Raises:
        ValueError: ``root`` is out of range, or ``data`` is None on ``root``.
    """
    if not 0 <= root < size:
        raise ValueError(f"root {root} is out of range for a communicator of size {size}")
    if rank == root and data is None:
        raise ValueError("broadcast_bytes: the root rank must pass data")


def lend_broadcast(comm: Communicator, data: bytearray | None, root: int, *,
                   timeout: float | None = None) -> bytes | bytearray:
    """Broadcast bulk ``data`` from ``root`` without the copies ``broadcast_bytes`` makes
    where ``comm`` offers ``broadcast_buffer`` (distcache's own communicators do): the
    root lends ``data`` and must not change it afterwards. Any other communicator gets
    a plain ``broadcast_bytes``."""
    lend = getattr(comm, "broadcast_buffer", None)
    if lend is not None:
        received: bytes | bytearray = lend(data, root, timeout=timeout)
        return received
    return comm.broadcast_bytes(None if data is None else bytes(data), root, timeout=timeout)


def chunk_spans(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` spans that cover ``total`` bytes in pieces of at most ``chunk``."""
    if chunk <= 0:
        raise ValueError(f"chunk size must be > 0, got {chunk}")
    if total == 0:
        return
    for start in range(0, total, chunk):
        yield start, min(start + chunk, total)


def agree_on_error(
    comm: Communicator, error: BaseException | None, *, timeout: float | None = None
) -> None:
    """Collective: if any rank passes an error, every rank raises one.

    The rank that failed re-raises its own error; every other rank raises the lowest
    failing rank's error when it is a (picklable) :class:`DistcacheError`, else a
    :class:`RemoteError` that names the rank, its host and the original message.

    Raises:
        DistcacheError: some rank failed.
        CollectiveTimeout: not every rank arrived in time.
    """
    payload: tuple[str, str, BaseException | None] | None = None
    if error is not None:
        transportable: BaseException | None = error if isinstance(error, DistcacheError) else None
        payload = (type(error).__name__, str(error), transportable)
    gathered = comm.allgather_object((comm.node_id, payload), timeout=timeout)
    failures = [(r, host, p) for r, (host, p) in enumerate(gathered) if p is not None]
    if not failures:
        return
    if error is not None:
        raise error
    rank, host, (type_name, text, exc) = failures[0]
    if exc is not None:
        raise exc
    raise RemoteError(
        f"rank {rank}/{comm.size} on {host} failed with {type_name}: {text}",
        rank=rank,
        host=host,
        remote_type=type_name,
    )
