"""Leases in a producer pool: a best-fit free list of aligned ranges plus a table of
generation-tagged slots whose ready/ack words live in the shared segment itself.

Segment layout (both backends)::

    [slot 0: ready, ack[0..A)] [slot 1: ...] ... [pad to 256] [data ........]

Each word is a little-endian uint32. The producer writes a slot's ready word (the
lease's generation) after the feature's bytes; each consumer writes its own ack word
when it is done, by writing shared memory, so releasing a feature needs no collective
and no message. The producer returns a range to the free list only when every
consumer's ack equals the lease's generation (a stale ack of an earlier use of the slot
never frees it), and it does so lazily, when an allocation would otherwise fail. This
follows SGLang's stream-ordered feature pool (see the CUDA IPC research notes, 1.6): a
free list rather than a ring, because features are not consumed in FIFO order under
aborts, retries and caching.

This module is the bookkeeping only, over any :class:`ControlWords`; the pool object
that owns the memory and hands out refs is :class:`distcache.ipc._producer.ProducerPool`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

from distcache.errors import IpcError
from distcache.ipc._ref import MAX_GENERATION

ALIGNMENT = 256
WORD_BYTES = 4


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


def header_bytes(slots: int, ack_words: int) -> int:
    """Bytes of control words before the data region, rounded up to the alignment."""
    return align_up(max(1, slots * (1 + ack_words) * WORD_BYTES))


class ControlWords(Protocol):
    """The ready/ack words of every slot, wherever they live (host or device memory)."""

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

    def get(self, index: int) -> int:
        return int(self._words[index])

    def set(self, index: int, value: int) -> None:
        self._words[index] = value

    def rows(self, slots: list[int], width: int) -> list[list[int]]:
        words, stride = self._words, self._stride
        return [list(words[s * stride : s * stride + width]) for s in slots]

    def release(self) -> None:
        self._words.release()


@dataclass(frozen=True, slots=True)
class Lease:
    """A range of the data region bound to a slot and one generation of that slot."""

    offset: int
    size: int
    nbytes: int
    slot: int
    generation: int


class SlotAllocator:
    """Best-fit allocation of aligned ranges, tied to generation-tagged slots.

    Not thread-safe: a pool has one producer; the pool serialises calls.
    """

    def __init__(
        self,
        capacity: int,
        *,
        data_start: int,
        slots: int,
        ack_words: int,
        words: ControlWords,
        consumers: int | None = None,
    ) -> None:
        if data_start % ALIGNMENT or data_start < slots * (1 + ack_words) * WORD_BYTES:
            raise IpcError(f"data_start={data_start} overlaps the control words or is unaligned")
        if capacity < ALIGNMENT or slots < 1:
            raise IpcError(f"a pool needs >= {ALIGNMENT} bytes and >= 1 slot")
        self.capacity = capacity
        self.data_start = data_start
        self.slots = slots
        self.ack_words = ack_words
        self.words = words
        self.stride = 1 + ack_words
        self._consumers = consumers
        # Free ranges as parallel sorted lists of starts and ends (absolute offsets).
        self._starts = [data_start]
        self._ends = [data_start + capacity - capacity % ALIGNMENT]
        self._free_slots = list(reversed(range(slots)))
        self._generations = [0] * slots
        self._leases: dict[int, Lease] = {}

    @property
    def consumers(self) -> int | None:
        return self._consumers

    def bind(self, consumers: int) -> None:
        """Fix how many consumers must ack each lease.

        Raises:
            IpcError: more consumers than ack words, or already bound differently.
        """
        if not 0 <= consumers <= self.ack_words:
            raise IpcError(
                f"{consumers} consumers but the pool has {self.ack_words} ack words per slot; "
                "create the pool with consumers=[ranks...] to size it"
            )
        if self._consumers is not None and self._consumers != consumers:
            raise IpcError(f"pool already bound to {self._consumers} consumers, not {consumers}")
        self._consumers = consumers

    @property
    def in_flight(self) -> int:
        return len(self._leases)

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def allocate(self, nbytes: int) -> Lease | None:
        """A lease for ``nbytes``, or None when no range or slot is free even after
        reclaiming acknowledged leases.

        Raises:
            IpcError: no consumer count is bound yet.
        """
        if self._consumers is None:
            raise IpcError("the pool's consumers are not known yet; exchange the pool first")
        size = align_up(max(nbytes, 1))
        lease = self._try_allocate(nbytes, size)
        if lease is None and self.reclaim():
            lease = self._try_allocate(nbytes, size)
        return lease

    def _try_allocate(self, nbytes: int, size: int) -> Lease | None:
        if not self._free_slots:
            return None
        best = -1
        best_len = 0
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            length = end - start
            if length >= size and (best < 0 or length < best_len):
                best, best_len = i, length
                if length == size:
                    break
        if best < 0:
            return None
        start = self._starts[best]
        if best_len == size:
            del self._starts[best], self._ends[best]
        else:
            self._starts[best] = start + size
        slot = self._free_slots.pop()
        generation = self._generations[slot] % MAX_GENERATION + 1
        self._generations[slot] = generation
        lease = Lease(offset=start, size=size, nbytes=nbytes, slot=slot, generation=generation)
        self._leases[slot] = lease
        return lease

    def publish(self, lease: Lease) -> None:
        """Mark the lease's bytes as written: its slot's ready word = its generation."""
        self._check_live(lease.slot, lease.generation)
        self.words.set(lease.slot * self.stride, lease.generation)

    def reclaim(self) -> int:
        """Free every lease whose consumers have all acknowledged it. Returns the count."""
        if not self._leases:
            return 0
        width = 1 + (self._consumers or 0)
        slots = list(self._leases)
        freed = 0
        for slot, row in zip(slots, self.words.rows(slots, width), strict=True):
            generation = self._leases[slot].generation
            if row[0] == generation and all(w == generation for w in row[1:]):
                self._release(slot)
                freed += 1
        return freed

    def cancel(self, slot: int, generation: int) -> None:
        """Free a lease that was never sent (no consumer will ack it).

        Raises:
            IpcError: no such lease is outstanding.
        """
        self._check_live(slot, generation)
        self._release(slot)

    def _check_live(self, slot: int, generation: int) -> None:
        lease = self._leases.get(slot)
        if lease is None or lease.generation != generation:
            raise IpcError(
                f"slot {slot} generation {generation} is not an outstanding lease of this pool "
                "(already released, cancelled, or never issued)"
            )

    def _release(self, slot: int) -> None:
        lease = self._leases.pop(slot)
        # Clear the ready word first: a late resolve of this (slot, generation) must
        # fail its ready check rather than read whatever the range holds next.
        self.words.set(slot * self.stride, 0)
        self._free_slots.append(slot)
        self._insert_free(lease.offset, lease.offset + lease.size)

    def _insert_free(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] == start:  # coalesce with the range before
            i -= 1
            start = self._starts[i]
            del self._starts[i], self._ends[i]
        if i < len(self._starts) and self._starts[i] == end:  # and the one after
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)
