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
"""

from __future__ import annotations

import bisect
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

from distcache.errors import IpcError
from distcache.ipc.ref import MAX_GENERATION, FeatureRef, PoolDescriptor, check_pool_id, itemsize

__all__ = [
    "ALIGNMENT",
    "DEFAULT_ACK_WORDS",
    "DEFAULT_SLOTS",
    "WORD_BYTES",
    "ControlWords",
    "Lease",
    "ProducerPool",
    "SlotAllocator",
    "WordArray",
    "align_up",
    "header_bytes",
]

log = logging.getLogger(__name__)

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


#: Ack words per slot when the consumers are only known at exchange time (one
#: slot is then 256 bytes of control words).
DEFAULT_ACK_WORDS = 63
DEFAULT_SLOTS = 1024


class ProducerPool:
    """What both backends share: leases, ``put``, ``cancel``, the descriptor.

    A backend provides the memory (``_words``, ``_write``, ``_handle``) and its
    lifetime (``_free``, ``unlink``).
    """

    backend = ""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        consumers: Sequence[int] | None,
        name: str | None,
        slots: int,
        device: int,
    ) -> None:
        if type(capacity_bytes) is not int or capacity_bytes <= 0:
            raise IpcError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if type(slots) is not int or not 1 <= slots <= 1 << 20:
            raise IpcError(f"slots must be an integer in [1, 2**20], got {slots!r}")
        self.pool_id = (
            name if name is not None else f"{self.backend}-{os.getpid()}-{secrets.token_hex(4)}"
        )
        check_pool_id(self.pool_id)
        # A restarted producer gets a later epoch, so consumers can tell its refs
        # from the previous incarnation's even though the pool id is the same.
        self.epoch = time.time_ns()
        self.capacity = align_up(capacity_bytes)
        self.slots = slots
        self.device = device
        self._explicit = tuple(int(r) for r in consumers) if consumers is not None else None
        self.ack_words = len(self._explicit) if self._explicit is not None else DEFAULT_ACK_WORDS
        self.data_start = header_bytes(slots, self.ack_words)
        self.owner: int | None = None
        self.node_id = ""
        self.consumers: tuple[int, ...] | None = None
        #: Number of ``put`` calls answered "no lease" because the pool was full.
        self.full_count = 0
        self._lock = threading.Lock()
        self._closed = False
        self._alloc: SlotAllocator | None = None

    def _start(self, words: ControlWords) -> None:
        self._alloc = SlotAllocator(
            self.capacity,
            data_start=self.data_start,
            slots=self.slots,
            ack_words=self.ack_words,
            words=words,
        )
        if self._explicit is not None:
            self._alloc.bind(len(self._explicit))

    # -- backend hooks --------------------------------------------------------------
    def _handle(self) -> bytes:
        raise NotImplementedError

    def _write(self, offset: int, tensor: Any) -> None:
        raise NotImplementedError

    def _check_tensor(self, tensor: Any) -> None:
        raise NotImplementedError

    def _free(self) -> None:
        raise NotImplementedError

    def unlink(self) -> None:
        """Remove the pool's system-wide name, if it has one; existing mappings stay."""

    # -- protocol -------------------------------------------------------------------
    def bind(self, owner: int, consumers: Sequence[int], node_id: str = "") -> None:
        """Fix the owner rank and the consumer ranks (the registry does this at exchange).

        ``consumers`` is ignored when the pool was created with explicit consumers.

        Raises:
            IpcError: the owner is among the consumers, or there are more consumers than
                ack words per slot.
        """
        ranks = self._explicit if self._explicit is not None else tuple(consumers)
        if owner in ranks:
            raise IpcError(
                f"pool {self.pool_id}: owner rank {owner} cannot consume its own pool",
                pool_id=self.pool_id,
            )
        if len(ranks) > self.ack_words:
            raise IpcError(
                f"pool {self.pool_id} has {len(ranks)} consumers but only {self.ack_words} ack "
                "words per slot; pass consumers=[ranks...] when creating it",
                pool_id=self.pool_id,
            )
        with self._lock:
            self._allocator().bind(len(ranks))
            self.owner, self.consumers, self.node_id = owner, ranks, node_id

    def descriptor(self) -> PoolDescriptor:
        """How a consumer maps this pool.

        Raises:
            IpcError: the pool is closed or not bound to an owner and consumers yet.
        """
        self._check_open()
        if self.owner is None or self.consumers is None:
            raise IpcError(
                f"pool {self.pool_id} is not bound to an owner yet; exchange it first",
                pool_id=self.pool_id,
            )
        return PoolDescriptor(
            pool_id=self.pool_id,
            backend=self.backend,
            owner=self.owner,
            node_id=self.node_id,
            epoch=self.epoch,
            capacity=self.capacity,
            data_start=self.data_start,
            slots=self.slots,
            ack_words=self.ack_words,
            device=self.device,
            consumers=self.consumers,
            handle=self._handle(),
        )

    def put(self, tensor: Any, *, with_descriptor: bool = False) -> FeatureRef | None:
        """Copy a contiguous tensor into a lease; None when the pool is full.

        A full pool answers at once (the caller sends a copy instead) and is logged
        once per pool, not per call. ``with_descriptor`` makes the ref carry the pool's
        descriptor, so a consumer that has not mapped this epoch can map it.

        Raises:
            IpcError: the pool is closed or not exchanged yet, or the tensor is not
                contiguous, on the wrong device, or of an unsupported dtype.
        """
        self._check_open()
        self._check_tensor(tensor)
        if not tensor.is_contiguous():
            raise IpcError(
                "put() needs a contiguous tensor; call .contiguous() first", pool_id=self.pool_id
            )
        dtype = str(tensor.dtype).removeprefix("torch.")
        nbytes = int(tensor.numel()) * itemsize(dtype)
        with self._lock:
            self._check_open()
            alloc = self._allocator()
            lease = alloc.allocate(nbytes)
            if lease is None:
                self.full_count += 1
                level = logging.WARNING if self.full_count == 1 else logging.DEBUG
                log.log(
                    level,
                    "IPC pool %s is full (%d bytes, %d leases in flight): features "
                    "are sent by copy until consumers acknowledge; consider a larger pool",
                    self.pool_id,
                    self.capacity,
                    alloc.in_flight,
                )
                return None
            try:
                self._write(lease.offset, tensor)
            except BaseException:
                alloc.cancel(lease.slot, lease.generation)
                raise
            alloc.publish(lease)
        return FeatureRef(
            pool_id=self.pool_id,
            epoch=self.epoch,
            offset=lease.offset,
            nbytes=nbytes,
            dtype=dtype,
            shape=tuple(int(d) for d in tensor.shape),
            strides=tuple(int(s) for s in tensor.stride()),
            slot=lease.slot,
            generation=lease.generation,
            descriptor=self.descriptor() if with_descriptor else None,
        )

    def cancel(self, ref: FeatureRef) -> None:
        """Free a lease whose ref was never sent.

        Raises:
            IpcError: the ref is not an outstanding lease of this pool.
        """
        if (ref.pool_id, ref.epoch) != (self.pool_id, self.epoch):
            raise IpcError(
                f"ref of pool {ref.pool_id} epoch {ref.epoch} cancelled on pool "
                f"{self.pool_id} epoch {self.epoch}",
                pool_id=self.pool_id,
            )
        with self._lock:
            self._check_open()
            self._allocator().cancel(ref.slot, ref.generation)

    def reclaim(self) -> int:
        """Free every lease all consumers acknowledged (``put`` also does this lazily)."""
        with self._lock:
            self._check_open()
            return self._allocator().reclaim()

    @property
    def in_flight(self) -> int:
        """Leases not yet acknowledged by every consumer (as of the last reclaim)."""
        return self._allocator().in_flight

    @property
    def free_bytes(self) -> int:
        return self._allocator().free_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the pool's memory (idempotent). Consumers must have closed first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _allocator(self) -> SlotAllocator:
        if self._alloc is None:
            raise IpcError(f"pool {self.pool_id} has no memory", pool_id=self.pool_id)
        return self._alloc

    def _check_open(self) -> None:
        if self._closed:
            raise IpcError(f"pool {self.pool_id} is closed", pool_id=self.pool_id)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(pool_id={self.pool_id!r}, epoch={self.epoch}, "
            f"capacity={self.capacity})"
        )
