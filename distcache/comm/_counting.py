"""A communicator that counts what each rank sends and receives.

:class:`CountingCommunicator` wraps any :class:`~distcache.comm._base.Communicator`
and adds up, per rank, the payload bytes its collectives move, in the wire form
(:mod:`distcache.comm._codec`) the backends send:

* ``allgather_object``: this rank's encoded payload is sent, every other rank's is
  received;
* ``broadcast_bytes`` (and ``broadcast_buffer``): the root sends the data once, every
  other rank receives it;
* ``split``: the all-gather of ``(color, broken)`` every backend's split makes first;
* ``barrier``: no payload.

A communicator of one rank moves nothing. The children ``split`` returns count into
the same :class:`Traffic`, so one object holds everything a rank moved over the
communicator and every group split off it. The figures are the payloads leaving and
entering the rank, not what a transport forwards on their behalf (a tree broadcast
relays through intermediate ranks). Wrapping costs one extra encoding per payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from distcache.comm._base import Communicator, Forwarding, lend_broadcast
from distcache.comm._codec import encode


@dataclass
class Traffic:
    """What one rank moved: bytes sent and received, and collective calls, per op."""

    sent: int = 0
    received: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    #: ``op -> [sent, received]``: the same bytes by collective.
    by_op: dict[str, list[int]] = field(default_factory=dict)

    def count(self, op: str, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.calls[op] = self.calls.get(op, 0) + 1
        figures = self.by_op.setdefault(op, [0, 0])
        figures[0] += sent
        figures[1] += received

    def snapshot(self) -> tuple[int, int]:
        """``(sent, received)`` so far."""
        return self.sent, self.received


class CountingCommunicator(Forwarding):
    """``base`` with every collective's payload counted in :attr:`traffic`."""

    def __init__(self, base: Communicator, traffic: Traffic | None = None) -> None:
        self._base = base
        self.traffic = traffic if traffic is not None else Traffic()

    def __repr__(self) -> str:
        return f"CountingCommunicator({self._base!r})"

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        gathered = self._base.allgather_object(obj, timeout=timeout)
        if self.size > 1:
            me = self.rank
            self.traffic.count("allgather_object", len(encode(obj)),
                               sum(len(encode(x)) for r, x in enumerate(gathered) if r != me))
        return gathered

    def broadcast_bytes(self, data: bytes | None, root: int, *,
                        timeout: float | None = None) -> bytes:
        received = self._base.broadcast_bytes(data, root, timeout=timeout)
        self._count_broadcast(root, len(received))
        return received

    def broadcast_buffer(self, data: bytearray | None, root: int, *,
                         timeout: float | None = None) -> bytes | bytearray:
        received = lend_broadcast(self._base, data, root, timeout=timeout)
        self._count_broadcast(root, len(received))
        return received

    def _count_broadcast(self, root: int, nbytes: int) -> None:
        if self.size > 1:
            mine = self.rank == root
            self.traffic.count("broadcast_bytes", nbytes if mine else 0, 0 if mine else nbytes)

    def barrier(self, *, timeout: float | None = None) -> None:
        self._base.barrier(timeout=timeout)
        self.traffic.count("barrier", 0, 0)

    def split(self, color: int) -> Communicator:
        child = self._base.split(color)
        if self.size > 1:
            part = len(encode((int(color), False)))
            self.traffic.count("split", part, part * (self.size - 1))
        return CountingCommunicator(child, self.traffic)

    def __getattr__(self, name: str) -> Any:
        if name == "group_owned" and hasattr(self._base, "group_owned"):
            return self._group_owned
        return super().__getattr__(name)

    def _group_owned(self, ranks: Sequence[int]) -> Communicator:
        """The wrapped communicator's ``group_owned``, its child counted (making it
        sends nothing of distcache's)."""
        return CountingCommunicator(self._base.group_owned(ranks),  # type: ignore[attr-defined]
                                    self.traffic)

    def split_owned(self, color: int) -> Communicator:
        """The wrapped communicator's ``split_owned`` (else its ``split``), counted."""
        owned = getattr(self._base, "split_owned", None)
        child = owned(color) if owned is not None else self._base.split(color)
        if self.size > 1:
            part = len(encode(int(color)))
            self.traffic.count("split", part, part * (self.size - 1))
        return CountingCommunicator(child, self.traffic)
