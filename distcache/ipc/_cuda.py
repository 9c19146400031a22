"""The GPU backend: one raw device allocation per pool, exported once with CUDA IPC,
and control words in host shared memory that both the host and the streams use.

Design, and why:

* **Memory: ``cuMemAlloc`` + ``cuIpcGetMemHandle``**, not VMM with POSIX-fd handles.
  The legacy IPC handle is 64 bytes of plain data, so a pool's descriptor can travel
  as bytes over any channel (an all-gather, the engine's ZMQ socket, a pipe) and a
  producer outside the consumers' communicator needs nothing else; a POSIX fd must be
  passed with ``SCM_RIGHTS`` over a Unix socket or taken with ``pidfd_getfd``, which
  needs ptrace rights. The allocation is outside torch's caching allocator, so
  ``expandable_segments:True`` in the engine changes nothing, and the export covers
  exactly the pool, not an allocator segment.
* **Ordering: stream memory operations** (``cuStreamWriteValue32`` and
  ``cuStreamWaitValue32``) on words in host memory registered with the device
  (``cuMemHostRegister``), not IPC events. ``put`` queues its copy and then the ready
  word on the producer's stream and returns; a consumer queues a wait for the ready
  word, its copy, then its ack word on its own stream. No host thread ever waits on a
  stream. Because the words are host memory, the producer reads acks with plain loads
  when it reclaims; with IPC events it would have to map one event per slot per
  consumer in the producer, and ask each with ``cuEventQuery``.
* Tensors are views over the raw pointer through ``__cuda_array_interface__``
  (``torch.as_tensor``), which keeps the mapping alive while any view is.

Teardown is ordered: a consumer unmaps (``cuIpcCloseMemHandle``) only after its queued
work settled, and only then marks itself ``LEFT``; the producer frees its allocation
only once every consumer left or died, and otherwise leaks it with a warning rather
than free memory a consumer maps.

torch and cuda-python are imported only inside functions: ``import distcache.ipc``
loads neither.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

from distcache._log import get_logger
from distcache.errors import IpcError
from distcache.ipc import _driver as drv
from distcache.ipc._allocator import Lease
from distcache.ipc._descriptor import PoolDescriptor
from distcache.ipc._devmap import pack_handle, stream_handle
from distcache.ipc._layout import WORD_BYTES, WordArray, align_up, in_process
from distcache.ipc._producer import DEFAULT_SLOTS, ProducerPool
from distcache.ipc._ref import FeatureRef
from distcache.ipc._shm import SHM_DIR, ShmPool, create_segment, segment_name
from distcache.ipc._stale import release

log = get_logger(__name__)


class CudaPool(ProducerPool):
    """A producer pool in raw GPU memory; ``put`` takes tensors on the pool's device.

    ``put`` queues the copy and the ready word on the current stream of the pool's
    device and returns without waiting: keep ``tensor`` alive (or produced on that
    same stream) until the copy ran, as for any asynchronous copy. If the group's
    probe rules CUDA IPC out, :meth:`PoolRegistry.exchange` switches the pool to host
    shared memory (:meth:`fall_back_to_host`); ``put`` then stages through the host.

    Raises:
        IpcError: CUDA or cuda-python is unavailable, or the allocation failed.
    """

    backend = "cuda"

    def __init__(
        self,
        capacity_bytes: int,
        device: int | str | Any,
        *,
        consumers: Sequence[int] | None = None,
        name: str | None = None,
        slots: int = DEFAULT_SLOTS,
        teardown_timeout: float = 10.0,
    ) -> None:
        import torch

        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise IpcError(f"CudaPool needs a CUDA device, got {dev}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        super().__init__(capacity_bytes, consumers=consumers, name=name, slots=slots, device=index)
        self.teardown_timeout = teardown_timeout
        self._host: ShmPool | None = None
        self._stream = 0
        self._slot_streams: dict[int, int] = {}
        self.segment = segment_name(self.pool_id, self.epoch)
        self.path = os.path.join(SHM_DIR, self.segment)
        self._ptr = 0
        #: Why this pool cannot be exported with CUDA IPC ("" when it can): the
        #: exchange then votes for host memory instead of failing on this rank.
        self.unusable = ""
        try:
            self._allocate(index)
        except IpcError as exc:
            self.unusable = str(exc)
            log.warning(
                "CUDA IPC pool %s cannot be exported (%s); the group will share host memory",
                self.pool_id,
                exc,
            )

    def _allocate(self, index: int) -> None:
        words_bytes = align_up(self.data_start, mmap.PAGESIZE)
        ptr = drv.mem_alloc(index, self.capacity)
        try:
            ipc = drv.ipc_handle(index, ptr)
            mm, held = create_segment(self.path, words_bytes, self.pool_id)
            try:
                addr = drv.buffer_address(mm)
                self._dev_words = drv.host_register(index, addr, words_bytes)
            except BaseException:
                mm.close()
                release(self.path, held)
                raise
        except BaseException:
            drv.mem_free(index, ptr)
            raise
        self._ptr, self._mm, self._addr = ptr, mm, addr
        self._linked, self._held = True, held
        self._finalizer = weakref.finalize(self, in_process, os.getpid(), release,
                                           self.path, held)
        self._share = pack_handle(
            ipc, drv.device_uuid(index), self.capacity, words_bytes, self.segment
        )
        self._data: Any = drv.device_tensor(ptr, self.capacity, None, index)
        self._words = WordArray(memoryview(mm)[: self.data_start], self.layout.stride)
        self._start(self._words)

    def fall_back_to_host(self) -> None:
        """Serve through a host shared-memory segment instead of CUDA IPC (before exchange)."""
        if self._host is None:
            self._host = ShmPool(
                self.capacity, consumers=self._explicit, name=self.pool_id, slots=self.slots
            )
            self.epoch = self._host.epoch
            self.backend = "shm"
            self._release_device()
            log.info("IPC pool %s falls back to host shared memory", self.pool_id)

    def _handle(self) -> bytes:
        if self.unusable:
            raise IpcError(
                f"CUDA IPC pool {self.pool_id} has no handle ({self.unusable}); call "
                "fall_back_to_host() or exchange it",
                pool_id=self.pool_id,
            )
        return self._share

    def _check_tensor(self, tensor: Any) -> None:
        dev = getattr(tensor, "device", None)
        if dev is None or dev.type != "cuda" or dev.index != self.device:
            raise IpcError(
                f"CudaPool on cuda:{self.device} cannot take a tensor on {dev}",
                pool_id=self.pool_id,
            )

    def _write(self, offset: int, tensor: Any) -> None:
        import torch

        flat = tensor.reshape(-1).view(torch.uint8)
        start = offset - self.data_start
        # Queued on the current stream of the pool's device; nothing waits for it.
        self._data[start : start + flat.numel()].copy_(flat, non_blocking=True)
        self._stream = stream_handle(None, self.device)

    def _publish(self, lease: Lease) -> None:
        index = self._allocator().ready_word(lease)
        drv.stream_write(
            self.device, self._stream, self._dev_words + WORD_BYTES * index, lease.generation
        )
        self._slot_streams[lease.slot] = self._stream

    def put(
        self,
        tensor: Any,
        consumers: Sequence[int] | None = None,
        *,
        with_descriptor: bool = False,
    ) -> FeatureRef | None:
        """As :meth:`ProducerPool.put`; returns once the copy and the ready word are
        queued on the stream, without waiting for them.

        Raises:
            IpcError: see :meth:`ProducerPool.put`.
        """
        if self._host is not None:
            self._check_tensor(tensor)
            ref = self._host.put(tensor.cpu(), consumers, with_descriptor=with_descriptor)
            self.full_count = self._host.full_count
            return ref
        if self.unusable:
            raise IpcError(
                f"CUDA IPC pool {self.pool_id} is unusable ({self.unusable}); exchange it "
                "so that it falls back to host memory",
                pool_id=self.pool_id,
            )
        return super().put(tensor, consumers, with_descriptor=with_descriptor)

    @property
    def in_flight(self) -> int:
        return self._host.in_flight if self._host is not None else super().in_flight

    @property
    def free_bytes(self) -> int:
        return self._host.free_bytes if self._host is not None else super().free_bytes

    def bind(self, owner: int | None, consumers: Sequence[int], node_id: str = "") -> None:
        if self.unusable and self._host is None:
            # Bound by its producer, not at an exchange: no probe will vote, and the
            # pool cannot be exported, so it serves through host memory from the start.
            log.warning(
                "CUDA IPC pool %s cannot be exported (%s); it is shared through host "
                "shared memory instead",
                self.pool_id,
                self.unusable,
            )
            self.fall_back_to_host()
        if self._host is None:
            super().bind(owner, consumers, node_id)
            return
        self._host.bind(owner, consumers, node_id)
        self.owner, self.consumers, self.node_id = owner, self._host.consumers, node_id
        self._bound = True

    def descriptor(self) -> PoolDescriptor:
        if self._host is not None:
            return self._host.descriptor()
        return super().descriptor()

    def cancel(self, ref: FeatureRef) -> None:
        if self._host is not None:
            self._host.cancel(ref)
            return
        # The copy and ready word of the lease may still be queued: they must land
        # before its range and slot can go to another feature.
        stream = self._slot_streams.pop(ref.slot, None)
        if stream is not None:
            drv.stream_synchronize(self.device, stream)
        super().cancel(ref)

    def reclaim(self) -> int:
        if self._host is not None:
            return self._host.reclaim()
        return super().reclaim()

    def holders(self) -> list[int]:
        if self._host is not None:
            return self._host.holders()
        return super().holders()

    def unlink(self) -> None:
        if self._host is not None:
            self._host.unlink()
        self._unlink_words()

    def _unlink_words(self) -> None:
        if self._linked:
            self._linked = False
            release(self.path, self._held)
            self._finalizer.detach()

    def _free(self) -> None:
        if self._host is not None:
            self._host.close()
            return
        self.unlink()
        deadline = time.monotonic() + self.teardown_timeout
        holders = self.holders()
        while holders and time.monotonic() < deadline:
            time.sleep(0.005)
            holders = self.holders()
        if holders:
            log.warning(
                "CUDA IPC pool %s: consumer(s) %s still map it after %.1f s; its %d bytes "
                "of device memory are left allocated until this process exits rather "
                "than freed under them",
                self.pool_id,
                holders,
                self.teardown_timeout,
                self.capacity,
            )
        self._release_device(free_memory=not holders)

    def _release_device(self, free_memory: bool = True) -> None:
        """Release the control words (their registration and mapping) and, unless
        consumers still map it, the device memory. The registration always goes with
        the mapping: a range left registered after the unmap makes the next mapping
        at that address fail to register (``HOST_MEMORY_ALREADY_REGISTERED``)."""
        if self._ptr:
            drv.synchronize(self.device)  # this producer's own queued copies land first
            self._data = None
            self._words.release()
            drv.host_unregister(self.device, self._addr)
            if free_memory:
                drv.mem_free(self.device, self._ptr)
            self._ptr = 0
            self._mm.close()
            self._unlink_words()
