"""In-process communicators: world size 1, and N ranks as N threads.

:class:`LocalCommunicator` is what a single-process engine gets. :class:`ThreadGroup`
runs N ranks as N threads of one process; it is how collective policy is tested at
world size N without launching processes, and it honours timeouts like the real
backends (a rank that never arrives makes the others raise ``CollectiveTimeout``).
Both send ``allgather_object`` payloads in the wire form the real backends use
(:mod:`distcache.comm._codec`), so a payload that could not cross ranks there fails
here too, at world size 1 as well.
"""

from __future__ import annotations

import threading
from typing import Any

from distcache.comm._base import Communicator, check_broadcast, check_timeout, hostname
from distcache.comm._codec import decode, decode_from, encode
from distcache.errors import CollectiveTimeout

_DEFAULT_TIMEOUT = 600.0


class LocalCommunicator:
    """World size 1: every collective returns at once."""

    def __init__(self, node_id: str | None = None) -> None:
        self._node_id = node_id if node_id is not None else hostname()

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def backend(self) -> str:
        return "local"

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        check_broadcast(0, 1, root, data)
        check_timeout(timeout)
        assert data is not None  # checked: rank 0 is the root
        return bytes(data)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        check_timeout(timeout)
        return [decode(encode(obj))]

    def barrier(self, *, timeout: float | None = None) -> None:
        check_timeout(timeout)

    def split(self, color: int) -> Communicator:
        return LocalCommunicator(self._node_id)

    def __repr__(self) -> str:
        return f"LocalCommunicator(node_id={self._node_id!r})"


class ThreadGroup:
    """Shared state of N thread-ranks. ``group.comm(rank)`` is each rank's view."""

    def __init__(
        self,
        size: int,
        node_ids: list[str] | None = None,
        *,
        timeout: float = _DEFAULT_TIMEOUT,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if node_ids is not None and len(node_ids) != size:
            raise ValueError(f"{len(node_ids)} node ids for {size} ranks")
        check_timeout(timeout)
        self.size = size
        self.node_ids = node_ids if node_ids is not None else ["node0"] * size
        self.timeout = timeout
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size
        self._lock = threading.Lock()
        self._children: dict[tuple[int, int], ThreadGroup] = {}
        # Splits each rank made, over every view of it (the key of the next child).
        self._splits = [0] * size
        #: Number of collectives each rank entered (tests read it).
        self.calls = [0] * size

    def comm(self, rank: int) -> ThreadCommunicator:
        return ThreadCommunicator(self, rank)

    def _exchange(self, rank: int, obj: Any, op: str, timeout: float | None) -> list[Any]:
        check_timeout(timeout)
        wait = self.timeout if timeout is None else timeout
        self.calls[rank] += 1
        self._slots[rank] = obj
        try:
            self._barrier.wait(wait)
            result = list(self._slots)
            self._barrier.wait(wait)
        except threading.BrokenBarrierError:
            raise CollectiveTimeout(
                f"{op} on thread-rank {rank}/{self.size} did not complete within {wait:g} s "
                "(a peer never arrived or gave up)",
                op=op,
                timeout=wait,
                rank=rank,
            ) from None
        return result

    def _child(self, rank: int, color: int, members: list[int]) -> ThreadGroup:
        """The group ``rank``'s next split makes (counted over every view of ``rank``)."""
        with self._lock:
            self._splits[rank] += 1
            key = (self._splits[rank], color)
            if key not in self._children:
                self._children[key] = ThreadGroup(
                    len(members), [self.node_ids[m] for m in members], timeout=self.timeout
                )
            return self._children[key]


class ThreadCommunicator:
    """One thread-rank's view of a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        if not 0 <= rank < group.size:
            raise ValueError(f"rank {rank} is out of range for a group of size {group.size}")
        self._group = group
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    @property
    def node_id(self) -> str:
        return self._group.node_ids[self._rank]

    @property
    def backend(self) -> str:
        return "threads"

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        check_broadcast(self._rank, self.size, root, data)
        mine = bytes(data) if self._rank == root and data is not None else None
        return bytes(self._group._exchange(self._rank, mine, "broadcast_bytes", timeout)[root])

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        parts = self._group._exchange(self._rank, encode(obj), "allgather_object", timeout)
        where = f"thread-rank {self._rank}/{self.size} ({self.node_id})"
        return [decode_from(part, peer, where, rank=self._rank, backend="threads")
                for peer, part in enumerate(parts)]

    def barrier(self, *, timeout: float | None = None) -> None:
        self._group._exchange(self._rank, None, "barrier", timeout)

    def split(self, color: int) -> Communicator:
        colors = self._group._exchange(self._rank, color, "split", None)
        members = [r for r, c in enumerate(colors) if c == color]
        child = self._group._child(self._rank, color, members)
        return child.comm(members.index(self._rank))

    def __repr__(self) -> str:
        return f"ThreadCommunicator(rank={self._rank}, size={self.size})"
