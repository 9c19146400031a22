"""A peer pool mapped into this process, and what serving needs of it precomputed.

The registry keeps one :class:`Entry` per mapped pool; everything the per-feature path
reads (bounds, this consumer's ack word and audience bit, typed views of the segment)
is computed here once at map time, and :meth:`Entry.check` checks a ref against it.
What differs between backends is how readiness and acknowledgement are ordered:
:class:`Mapping` says it in four hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from distcache._log import get_logger
from distcache.errors import IpcError
from distcache.ipc._consumers import ConsumerTable
from distcache.ipc._descriptor import PoolDescriptor
from distcache.ipc._devmap import CudaMapping
from distcache.ipc._layout import ALIGNMENT, EXTENT_WORDS, Layout, WordArray
from distcache.ipc._ref import FeatureRef
from distcache.ipc._shm import ShmMapping
from distcache.ipc._wire import itemsize

_LOW = 0xFFFFFFFF

log = get_logger(__name__)


class Mapping(Protocol):
    """A peer pool mapped into this process (host shared memory or CUDA IPC)."""

    descriptor: PoolDescriptor
    #: The device this process's views and copies live on; None for host memory.
    device: Any
    #: True when the ready word is final before a ref can arrive (host memory), so
    #: it is checked on the host; False when readiness is ordered on a stream.
    host_ready: bool

    @property
    def words(self) -> WordArray: ...

    def view(self, offset: int, nbytes: int) -> Any: ...

    def order_ready(self, index: int, generation: int, stream: Any) -> None:
        """Make work queued next on ``stream`` wait until word ``index`` is ``generation``."""
        ...

    def write_ack(self, index: int, generation: int, stream: Any) -> None:
        """Write ``generation`` into word ``index`` after the work queued on ``stream``."""
        ...

    def settle(self) -> None:
        """Wait for this process's queued work on the pool (teardown only)."""
        ...

    def close(self, leave: Callable[[], None] | None = None) -> None:
        """Unmap; call ``leave`` once this process can no longer touch the memory."""
        ...


#: The widest itemsize in :data:`~distcache.ipc._wire.DTYPES`; typed views of a
#: segment cover a multiple of it.
_MAX_ITEMSIZE = 8


class Entry:
    """One mapped peer pool and what ``resolve``/``fetch``/``ack`` need of it,
    precomputed at map time so the per-feature path is attribute reads, integer
    compares and one ``as_strided``: no descriptor walks, no intermediate tensors."""

    __slots__ = (
        "_typed",
        "_whole",
        "ack_off",
        "bit",
        "data_start",
        "descriptor",
        "end",
        "epoch",
        "extent_base",
        "host",
        "index",
        "mapping",
        "mask_off",
        "slots",
        "stride",
        "table",
        "words",
    )

    def __init__(self, mapping: Mapping, descriptor: PoolDescriptor, index: int) -> None:
        self.mapping = mapping
        self.descriptor = descriptor
        self.index = index  # this rank's consumer index (its ack word, its audience bit)
        layout = Layout(descriptor.slots, descriptor.ack_words)
        self.epoch = descriptor.epoch
        self.slots = descriptor.slots
        self.stride = layout.stride
        self.ack_off = layout.ack_base + index
        self.mask_off = 2 + index // 32
        self.bit = 1 << (index % 32)
        self.extent_base = layout.extent(0)
        self.data_start = descriptor.data_start
        # Typed views span whole elements of every dtype; a feature must end inside
        # that span (a forged, unaligned capacity only shrinks what resolves).
        self.end = descriptor.data_start + descriptor.capacity - descriptor.capacity % _MAX_ITEMSIZE
        #: The control words, indexed directly on the serving path.
        self.words = mapping.words.array
        self.host = mapping.host_ready
        self.table = ConsumerTable(mapping.words, layout)
        self.table.join(index, descriptor.pool_id)
        self._whole: Any = None
        #: dtype name -> (the segment viewed as that dtype, its storage offset, itemsize)
        self._typed: dict[str, tuple[Any, int, int]] = {}

    def check(self, ref: FeatureRef, rank: int) -> int:
        """The index of the slot row of ``ref`` (of this pool's epoch), after the bounds,
        lease, extent, audience and ack checks for consumer ``rank`` (all on host
        words: nothing here waits on a device).

        Raises:
            IpcError: the ref is outside the pool, its slot holds another lease or a
                lease of other bytes, or ``rank`` is not a declared reader, has
                acknowledged it already, or (host memory) it was never published.
        """
        # The serving hot path. A FeatureRef is immutable and was validated when it was
        # built or decoded (dtype known, nbytes == numel * itemsize, strides inside
        # nbytes), so what is left to check is the ref against this pool.
        slot, offset, nbytes, generation = ref.slot, ref.offset, ref.nbytes, ref.generation
        if (
            slot >= self.slots
            or offset < self.data_start
            or offset % ALIGNMENT
            or offset + nbytes > self.end
        ):
            raise IpcError(
                f"ref (slot {slot}, bytes [{offset}, {offset + nbytes})) is outside pool "
                f"{ref.pool_id} (slots {self.slots}, data [{self.data_start}, {self.end}))",
                pool_id=ref.pool_id,
            )
        row = slot * self.stride
        words = self.words
        # The lease word is written after the slot's audience and extent, before the
        # ref leaves the producer, and cleared only when the lease is released, which
        # cannot happen before this rank (a declared, live reader) acknowledged it.
        problem = None
        lease = words[row + 1]
        if lease != generation:
            problem = (
                "is not leased: it was released, cancelled or never issued (the slot "
                f"holds generation {lease})"
            )
        elif (words[at := self.extent_base + EXTENT_WORDS * slot] != offset & _LOW
              or words[at + 2] != nbytes & _LOW or words[at + 1] != offset >> 32
              or words[at + 3] != nbytes >> 32):
            start, size = self.extent(slot)
            problem = (
                f"was leased bytes [{start}, {start + size}), not the ref's "
                f"[{offset}, {offset + nbytes})"
            )
        elif not words[row + self.mask_off] & self.bit:
            problem = f"was not declared for rank {rank} (put(..., consumers=[...]))"
        elif words[row + self.ack_off] == generation:
            problem = "was already acknowledged by this rank"
        elif self.host and words[row] != generation:
            problem = "was never published"
        if problem is not None:
            raise IpcError(
                f"feature in slot {slot} generation {generation} of pool {ref.pool_id} {problem}",
                pool_id=ref.pool_id,
            )
        return row

    def extent(self, slot: int) -> tuple[int, int]:
        """The offset and byte count of the lease that ``slot`` holds, as its producer
        recorded them."""
        words, at = self.words, self.extent_base + EXTENT_WORDS * slot
        return words[at] | words[at + 1] << 32, words[at + 2] | words[at + 3] << 32

    def typed(self, dtype: str) -> tuple[Any, int, int]:
        """The data region as a ``dtype`` tensor (made once per dtype per mapping), the
        storage offset that segment offset 0 would have in it, and the itemsize: the
        element at segment byte ``o`` is at ``base + o // itemsize``."""
        found = self._typed.get(dtype)
        if found is None:
            import torch

            if self._whole is None:
                self._whole = self.mapping.view(self.data_start, self.end - self.data_start)
            size = itemsize(dtype)
            view = self._whole.view(getattr(torch, dtype))
            found = self._typed[dtype] = (
                view,
                view.storage_offset() - self.data_start // size,
                size,
            )
        return found

    def close(self) -> None:
        """Leave the pool in order: queued work on it lands, the producer learns this
        consumer acknowledges nothing more (its leases are released), then unmap."""
        try:
            self.mapping.settle()
        except Exception as exc:  # teardown must reach the unmap whatever happens
            log.warning("pool %s: pending work did not settle: %s", self.descriptor.pool_id, exc)
        # The cached views must go first: a live view of a host segment defers its unmap.
        self._typed.clear()
        self._whole = None
        table, index = self.table, self.index
        self.mapping.close(lambda: table.leave(index))


def open_mapping(descriptor: PoolDescriptor, device: int | None) -> Mapping:
    """Map a peer pool with the backend its descriptor names.

    Raises:
        IpcError: the segment or the CUDA handle could not be opened.
    """
    if descriptor.backend == "shm":
        return ShmMapping(descriptor)
    return CudaMapping(descriptor, device)


def close_all(entries: dict[str, Entry]) -> None:
    """Unmap every entry once and forget them (the registry's finalizer)."""
    for entry in entries.values():
        entry.close()
    entries.clear()
