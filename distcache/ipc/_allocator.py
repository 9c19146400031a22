"""Leases in a producer pool: a best-fit free list of aligned ranges plus a table of
generation-tagged slots whose ready/lease/audience/ack/extent words live in the shared
segment (layout: :mod:`distcache.ipc._layout`).

Each lease names its audience, the consumers that must acknowledge it (every consumer
by default, or only the declared readers). Each consumer writes its own ack word when
it is done, by writing shared memory, so releasing a feature needs no collective and
no message. The producer returns a range to the free list only when every consumer
of the audience acked the lease's generation (a stale ack of an earlier use of the
slot never frees it) or is gone (left, or died: :mod:`distcache.ipc._consumers`), and
it does so lazily, when an allocation would otherwise fail. This follows SGLang's
stream-ordered feature pool (see the CUDA IPC research notes, 1.6): a free list
rather than a ring, because features are not consumed in FIFO order under aborts,
retries and caching.

This module is the bookkeeping only, over any :class:`ControlWords`; the pool object
that owns the memory and hands out refs is :class:`distcache.ipc._producer.ProducerPool`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from distcache.errors import IpcError
from distcache.ipc._layout import (
    ALIGNMENT,
    ControlWords,
    Layout,
    align_up,
    audience_words,
    extent_words,
)
from distcache.ipc._wire import MAX_GENERATION


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

    Not thread-safe: a pool has one producer; the pool serialises calls. ``gone(i)``
    tells whether consumer ``i`` left or died (its leases are then released without
    its ack); by default nobody is ever gone.
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
        gone: Callable[[int], bool] | None = None,
    ) -> None:
        self.layout = Layout(slots, ack_words)
        if data_start % ALIGNMENT or data_start < self.layout.words * 4:
            raise IpcError(f"data_start={data_start} overlaps the control words or is unaligned")
        if capacity < ALIGNMENT or slots < 1:
            raise IpcError(f"a pool needs >= {ALIGNMENT} bytes and >= 1 slot")
        self.capacity = capacity
        self.data_start = data_start
        self.slots = slots
        self.ack_words = ack_words
        self.words = words
        self.stride = self.layout.stride
        self._consumers = consumers
        self._gone = gone if gone is not None else (lambda index: False)
        # Free ranges as parallel sorted lists of starts and ends (absolute offsets).
        self._starts = [data_start]
        self._ends = [data_start + self.largest]
        self._free_slots = list(reversed(range(slots)))
        self._generations = [0] * slots
        self._leases: dict[int, Lease] = {}
        self._audiences: dict[int, tuple[int, ...]] = {}

    @property
    def largest(self) -> int:
        """The most bytes one lease can ever hold: the data region, whole and aligned."""
        return self.capacity - self.capacity % ALIGNMENT

    @property
    def consumers(self) -> int | None:
        return self._consumers

    def bind(self, consumers: int) -> None:
        """Fix how many consumers the pool has (each lease's audience is among them).

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

    def allocate(self, nbytes: int, audience: tuple[int, ...] | None = None, *,
                 pool_id: str | None = None) -> Lease | None:
        """A lease for ``nbytes`` read by consumer indices ``audience`` (None: every
        consumer), or None when no range or slot is free even after reclaiming
        (``pool_id``: the pool's, for the messages).

        The slot's audience, extent and lease words are written before this returns
        (the lease word last), so a consumer that receives the ref finds them in place.

        Raises:
            IpcError: no consumer count is bound yet, the audience names an index
                that is not a consumer, or ``nbytes`` is more than :attr:`largest`
                (no lease can ever hold it, so None would mean wait for nothing).
        """
        if nbytes > self.largest:
            raise IpcError(
                f"{nbytes} bytes can never fit in {f'IPC pool {pool_id}' if pool_id else 'the pool'}"
                f", whose capacity is {self.largest} bytes; send the feature by copy or use a "
                "larger pool",
                pool_id=pool_id)
        if self._consumers is None:
            raise IpcError("the pool's consumers are not known yet; exchange the pool first")
        readers = tuple(range(self._consumers)) if audience is None else audience
        if any(not 0 <= i < self._consumers for i in readers):
            raise IpcError(
                f"audience {readers} names a consumer index outside 0..{self._consumers - 1}"
            )
        size = align_up(max(nbytes, 1))
        lease = self._try_allocate(nbytes, size)
        if lease is None and self.reclaim():
            lease = self._try_allocate(nbytes, size)
        if lease is not None:
            self._audiences[lease.slot] = readers
            layout, words = self.layout, self.words
            for w, value in enumerate(audience_words(list(readers), layout.mask_words)):
                words.set(layout.mask(lease.slot) + w, value)
            for w, value in enumerate(extent_words(lease.offset, lease.nbytes)):
                words.set(layout.extent(lease.slot) + w, value)
            words.set(layout.lease(lease.slot), lease.generation)
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

    def ready_word(self, lease: Lease) -> int:
        """Index of the word that says the lease's bytes landed (checks it is live).

        Raises:
            IpcError: the lease is not outstanding.
        """
        self._check_live(lease.slot, lease.generation)
        return self.layout.ready(lease.slot)

    def publish(self, lease: Lease) -> None:
        """Mark the lease's bytes as written, from the host: ready word = generation."""
        self.words.set(self.ready_word(lease), lease.generation)

    def reclaim(self) -> int:
        """Free every lease each of whose readers acknowledged it or is gone; the
        count freed. Gone-ness is asked at most once per consumer per call."""
        if not self._leases:
            return 0
        width, base = self.stride, self.layout.ack_base
        slots = list(self._leases)
        gone: dict[int, bool] = {}
        freed = 0
        for slot, row in zip(slots, self.words.rows(slots, width), strict=True):
            generation = self._leases[slot].generation
            if row[0] != generation:
                continue
            done = True
            for i in self._audiences[slot]:
                if row[base + i] == generation:
                    continue
                if i not in gone:
                    gone[i] = self._gone(i)
                if not gone[i]:
                    done = False
                    break
            if done:
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
        del self._audiences[slot]
        # Clear the lease word first: a late resolve of this (slot, generation) must
        # fail its check rather than read whatever the range holds next.
        layout, words = self.layout, self.words
        words.set(layout.lease(slot), 0)
        words.set(layout.ready(slot), 0)
        for w in range(layout.mask_words):
            words.set(layout.mask(slot) + w, 0)
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
