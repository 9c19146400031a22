"""A peer pool mapped into this process, and what serving needs of it precomputed.

The registry keeps one :class:`Entry` per mapped pool; everything the per-feature path
reads (bounds, the ack word's index, typed views of the segment) is computed here once
at map time.
"""

from __future__ import annotations

from typing import Any, Protocol

from distcache.ipc._allocator import ControlWords
from distcache.ipc._cuda import CudaMapping
from distcache.ipc._ref import PoolDescriptor, itemsize
from distcache.ipc._shm import ShmMapping


class Mapping(Protocol):
    """A peer pool mapped into this process (host shared memory or CUDA IPC)."""

    descriptor: PoolDescriptor

    @property
    def words(self) -> ControlWords: ...

    def view(self, offset: int, nbytes: int) -> Any: ...

    def close(self) -> None: ...


#: The widest itemsize in :data:`~distcache.ipc._ref.DTYPES`; typed views of a
#: segment cover a multiple of it.
_MAX_ITEMSIZE = 8


class Entry:
    """One mapped peer pool and what ``resolve``/``ack`` need of it, precomputed at map
    time so the per-feature path is attribute reads, integer compares and one
    ``as_strided``: no descriptor walks, no dtype look-ups, no intermediate tensors."""

    __slots__ = (
        "_typed",
        "_whole",
        "ack_base",
        "data_start",
        "descriptor",
        "end",
        "epoch",
        "get_word",
        "index",
        "mapping",
        "set_word",
        "slots",
        "stride",
    )

    def __init__(self, mapping: Mapping, descriptor: PoolDescriptor, index: int) -> None:
        self.mapping = mapping
        self.descriptor = descriptor
        self.index = index  # this rank's consumer index (its ack word)
        self.epoch = descriptor.epoch
        self.slots = descriptor.slots
        self.stride = 1 + descriptor.ack_words
        self.ack_base = 1 + index
        self.data_start = descriptor.data_start
        # Typed views span whole elements of every dtype; a feature must end inside
        # both the data region and that span (a forged, unaligned capacity only
        # shrinks what resolves).
        usable = descriptor.segment_bytes - descriptor.segment_bytes % _MAX_ITEMSIZE
        self.end = min(descriptor.data_start + descriptor.capacity, usable)
        words = mapping.words
        self.get_word = words.get
        self.set_word = words.set
        self._whole: Any = None
        #: dtype name -> (the segment viewed as that dtype, its storage offset, itemsize)
        self._typed: dict[str, tuple[Any, int, int]] = {}

    def typed(self, dtype: str) -> tuple[Any, int, int]:
        """The whole segment as a ``dtype`` tensor (made once per dtype per mapping)."""
        found = self._typed.get(dtype)
        if found is None:
            import torch

            if self._whole is None:
                usable = self.descriptor.segment_bytes
                self._whole = self.mapping.view(0, usable - usable % _MAX_ITEMSIZE)
            size = itemsize(dtype)
            view = self._whole.view(getattr(torch, dtype))
            found = self._typed[dtype] = (view, view.storage_offset(), size)
        return found

    def close(self) -> None:
        # The cached views must go first: a live view of a host segment defers its unmap.
        self._typed.clear()
        self._whole = None
        self.mapping.close()


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
