"""Where every control word of a pool segment lives, and the host view of those words.

Segment layout (both backends)::

    [slot 0: ready, lease, audience[M], ack[A]] [slot 1: ...] ...
    [slot 0's extent: offset lo, offset hi, nbytes lo, nbytes hi] [slot 1's ...] ...
    [consumer 0: state, pid, pid namespace] [consumer 1: ...] ... [pad to 256] [data ...]

Each word is a little-endian uint32 in host memory (the CUDA backend keeps its control
words in host shared memory too, registered with the device, so the producer reads
acks with plain loads and never waits on a stream). ``A`` is the number of ack words
per slot (one per consumer), ``M = ceil(A / 32)`` words hold the slot's audience: bit
``i`` set means consumer ``i`` is a declared reader of the lease and must acknowledge
it. ``lease`` is the generation the producer handed out (written before the ref
leaves), ``ready`` the generation whose bytes have landed (written after the copy:
by the host on shared memory, by the producer's stream on CUDA). A slot's extent is
the byte offset (in the segment) and the byte count of its current lease, each as two
words, low first, written before the lease word: a consumer serves a ref only when
its offset and bytes are the extent of the slot it names. Every word has one
writer: the producer writes ready, lease, audience and extent; consumer ``i`` writes
only its ack words and its own row of the consumer table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

ALIGNMENT = 256
WORD_BYTES = 4
#: Words per consumer in the consumer table: state, pid, pid namespace inode.
CONSUMER_WORDS = 3
#: Words per slot in the extent table: offset and nbytes, each as two uint32 words.
EXTENT_WORDS = 4

#: Consumer states (the table's first word per consumer).
ABSENT, MAPPED, LEFT = 0, 1, 2


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True)
class Layout:
    """Word indices of a pool with ``slots`` slots and ``ack_words`` consumers at most."""

    slots: int
    ack_words: int

    @property
    def mask_words(self) -> int:
        return (self.ack_words + 31) // 32

    @property
    def stride(self) -> int:
        """Words per slot row."""
        return 2 + self.mask_words + self.ack_words

    @property
    def ack_base(self) -> int:
        """Index of ack word 0 inside a slot row."""
        return 2 + self.mask_words

    def ready(self, slot: int) -> int:
        return slot * self.stride

    def lease(self, slot: int) -> int:
        return slot * self.stride + 1

    def mask(self, slot: int) -> int:
        return slot * self.stride + 2

    def ack(self, slot: int, consumer: int) -> int:
        return slot * self.stride + self.ack_base + consumer

    def extent(self, slot: int) -> int:
        """Index of the first extent word of ``slot`` (offset low, offset high, nbytes
        low, nbytes high)."""
        return self.slots * self.stride + EXTENT_WORDS * slot

    def consumer(self, index: int) -> int:
        """Index of consumer ``index``'s state word (pid and namespace follow)."""
        return self.slots * (self.stride + EXTENT_WORDS) + CONSUMER_WORDS * index

    @property
    def words(self) -> int:
        return self.slots * (self.stride + EXTENT_WORDS) + CONSUMER_WORDS * self.ack_words

    @property
    def header_bytes(self) -> int:
        """Bytes of control words before the data region, rounded up to the alignment."""
        return align_up(max(1, self.words * WORD_BYTES))


def header_bytes(slots: int, ack_words: int) -> int:
    return Layout(slots, ack_words).header_bytes


def extent_words(offset: int, nbytes: int) -> list[int]:
    """A lease's offset and byte count as its slot's :data:`EXTENT_WORDS` extent words."""
    return [offset & 0xFFFFFFFF, offset >> 32, nbytes & 0xFFFFFFFF, nbytes >> 32]


def audience_words(indices: list[int], mask_words: int) -> list[int]:
    """The audience bitmask of consumer ``indices`` as ``mask_words`` uint32 words."""
    mask = 0
    for i in indices:
        mask |= 1 << i
    return [(mask >> (32 * w)) & 0xFFFFFFFF for w in range(mask_words)]


class ControlWords(Protocol):
    """The control words of a segment, wherever they are mapped."""

    def get(self, index: int) -> int: ...

    def set(self, index: int, value: int) -> None: ...

    def rows(self, slots: list[int], width: int) -> list[list[int]]:
        """Words ``[slot*stride, slot*stride + width)`` of each slot (one batched read)."""
        ...


class WordArray:
    """:class:`ControlWords` over a writable host buffer (an ``mmap``, a ``bytearray``).

    Aligned 4-byte stores and loads are single instructions on the platforms we run
    on; the producer's data writes precede its ready store in program order, and
    x86-64 keeps stores in order (on weakly ordered CPUs a fence would be needed).
    """

    def __init__(self, buffer: memoryview, stride: int) -> None:
        self._words = buffer.cast("B").cast("I")
        self._stride = stride

    @property
    def array(self) -> memoryview:
        """The words as a uint32 memoryview (the serving path indexes it directly)."""
        return self._words

    def get(self, index: int) -> int:
        return int(self._words[index])

    def set(self, index: int, value: int) -> None:
        self._words[index] = value

    def rows(self, slots: list[int], width: int) -> list[list[int]]:
        words, stride = self._words, self._stride
        return [list(words[s * stride : s * stride + width]) for s in slots]

    def release(self) -> None:
        self._words.release()


def in_process(pid: int, action: Callable[..., object], *args: Any) -> None:
    """``action(*args)`` in process ``pid`` only: the finalizer of what a process set
    up (a mapping, a segment's name) is inherited by a child it forks, and the child's
    exit must not undo its parent's (mark its consumer gone, unlink its segment)."""
    if os.getpid() == pid:
        action(*args)
