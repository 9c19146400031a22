"""The GPU backend: one device allocation per pool, exported once with CUDA IPC.

The producer allocates the whole segment (control words + data) as one tensor and
exports it once with ``UntypedStorage._share_cuda_()``; each consumer opens it once
with ``UntypedStorage._new_shared_cuda`` and holds the storage for the registry's
lifetime, which is what keeps torch's per-process IPC mapping open (research notes,
3.3-3.4). The device index in the handle is rewritten to the *consumer's* device, so
a consumer maps the producer's memory through peer access instead of creating a
context on the producer's GPU (~500 MiB per process; SGLang PR 22662). The handle
bytes are torch-version-coupled (PyTorch 2.5 added two bytes): producers and
consumers must run the same torch.

torch is imported only inside functions: ``import distcache.ipc`` never loads it.
"""

from __future__ import annotations

import logging
import platform
import struct
from collections.abc import Sequence
from typing import Any

from distcache.errors import IpcError
from distcache.ipc._producer import DEFAULT_SLOTS, ProducerPool
from distcache.ipc._ref import FeatureRef, PoolDescriptor
from distcache.ipc._shm import ShmPool

log = logging.getLogger(__name__)

_SHARE_HEAD = struct.Struct("<iQQQ?HHH")


def _pack_share(share: tuple[Any, ...]) -> bytes:
    device, handle, size, offset, counter, counter_offset, event, sync = share
    return (
        _SHARE_HEAD.pack(device, size, offset, counter_offset, bool(sync),
                         len(handle), len(counter), len(event))
        + bytes(handle) + bytes(counter) + bytes(event)
    )  # fmt: skip


def _unpack_share(data: bytes) -> tuple[Any, ...]:
    try:
        device, size, offset, c_off, sync, h_len, c_len, e_len = _SHARE_HEAD.unpack_from(data)
    except struct.error as exc:
        raise IpcError(f"garbled CUDA IPC handle ({exc})") from None
    pos = _SHARE_HEAD.size
    if len(data) != pos + h_len + c_len + e_len:
        raise IpcError("CUDA IPC handle length does not match its fields")
    handle = data[pos : pos + h_len]
    counter = data[pos + h_len : pos + h_len + c_len]
    event = data[pos + h_len + c_len :]
    return device, handle, size, offset, counter, c_off, event, sync


def probe_cuda_ipc(device: int | None = None) -> tuple[bool, str]:
    """Whether this process can use CUDA IPC: ``(usable, reason if not)``.

    Run once per rank at exchange; the group falls back to shared memory if any rank
    says no, so no request ever meets an unusable handle (e.g. WSL2's "invalid
    resource handle", SGLang issue 35385). Never raises.
    """
    if platform.system() != "Linux":
        return False, f"CUDA IPC is only supported on Linux, not {platform.system()}"
    if "microsoft" in platform.release().lower():
        return False, "CUDA IPC handles are not usable under WSL2"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    try:
        if not torch.cuda.is_available():
            return False, "no CUDA device is visible"
        if device is not None and not 0 <= device < torch.cuda.device_count():
            return False, f"device {device} does not exist"
    except Exception as exc:  # a broken driver must be a vote, not a crash
        return False, f"CUDA is unusable: {exc}"
    return True, ""


class _TensorWords:
    """:class:`ControlWords` over an int32 device tensor (generations fit in 31 bits)."""

    def __init__(self, words: Any, stride: int) -> None:
        self._words = words
        self._stride = stride

    def get(self, index: int) -> int:
        return int(self._words[index].item())

    def set(self, index: int, value: int) -> None:
        # Queued on the current stream, after this process's earlier work on it: a
        # consumer's ack lands only after its reads of the feature.
        self._words[index].fill_(value)

    def rows(self, slots: list[int], width: int) -> list[list[int]]:
        import torch

        # The control area is rounded up to the data alignment, so its length need not
        # be a multiple of the stride: view only the whole rows.
        whole = self._words.numel() // self._stride * self._stride
        table = self._words[:whole].view(-1, self._stride)
        index = torch.tensor(slots, dtype=torch.long, device=table.device)
        rows: list[list[int]] = table.index_select(0, index)[:, :width].tolist()
        return rows


class CudaPool(ProducerPool):
    """A producer pool in GPU memory; ``put`` takes tensors on the pool's device.

    If the group's capability probe rules CUDA IPC out, :meth:`PoolRegistry.exchange`
    switches the pool to a host shared-memory segment of the same size
    (:meth:`fall_back_to_host`); ``put`` then stages through host memory and
    consumers resolve CPU tensors.

    Raises:
        IpcError: CUDA is unavailable or the allocation failed.
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
    ) -> None:
        import torch

        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise IpcError(f"CudaPool needs a CUDA device, got {dev}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        super().__init__(capacity_bytes, consumers=consumers, name=name, slots=slots, device=index)
        self._host: Any = None
        try:
            # Zeros: every ready/ack word starts at generation 0 ("never issued").
            self._buf: Any = torch.zeros(
                self.data_start + self.capacity,
                dtype=torch.uint8,
                device=torch.device("cuda", index),
            )
            self._share = _pack_share(self._buf.untyped_storage()._share_cuda_())
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            raise IpcError(
                f"cannot allocate and export CUDA IPC pool {self.pool_id} "
                f"({self.data_start + self.capacity} bytes on cuda:{index}): {exc}",
                pool_id=self.pool_id,
            ) from exc
        self._start(
            _TensorWords(self._buf[: self.data_start].view(torch.int32), 1 + self.ack_words)
        )

    def fall_back_to_host(self) -> None:
        """Serve through a host shared-memory segment instead of CUDA IPC (before exchange)."""
        if self._host is None:
            self._host = ShmPool(
                self.capacity, consumers=self._explicit, name=self.pool_id, slots=self.slots
            )
            self.epoch = self._host.epoch
            self.backend = "shm"
            log.info("IPC pool %s falls back to host shared memory", self.pool_id)

    def _handle(self) -> bytes:
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
        self._buf[offset : offset + flat.numel()].copy_(flat)

    def put(self, tensor: Any, *, with_descriptor: bool = False) -> FeatureRef | None:
        """As :meth:`ProducerPool.put`; returns after the copy and the ready word landed.

        Raises:
            IpcError: see :meth:`ProducerPool.put`.
        """
        if self._host is not None:
            self._check_tensor(tensor)
            ref: FeatureRef | None = self._host.put(tensor.cpu(), with_descriptor=with_descriptor)
            return ref
        ref = super().put(tensor, with_descriptor=with_descriptor)
        if ref is not None:
            import torch

            # The ref leaves this process next; the consumer must find the bytes and the
            # ready word in place, not still queued on our stream.
            torch.cuda.current_stream(self.device).synchronize()
        return ref

    def bind(self, owner: int, consumers: Sequence[int], node_id: str = "") -> None:
        if self._host is not None:
            self._host.bind(owner, consumers, node_id)
        super().bind(owner, consumers, node_id)

    def descriptor(self) -> PoolDescriptor:
        if self._host is not None:
            desc: PoolDescriptor = self._host.descriptor()
            return desc
        return super().descriptor()

    def cancel(self, ref: FeatureRef) -> None:
        if self._host is not None:
            self._host.cancel(ref)
        else:
            super().cancel(ref)

    def reclaim(self) -> int:
        if self._host is not None:
            freed: int = self._host.reclaim()
            return freed
        return super().reclaim()

    def unlink(self) -> None:
        if self._host is not None:
            self._host.unlink()

    def _free(self) -> None:
        if self._host is not None:
            self._host.close()
        # Consumers must have closed their mappings first (freeing exported memory
        # before the importer closes it is undefined behaviour in CUDA).
        self._buf = None


class CudaMapping:
    """A consumer's one mapping of a peer's :class:`CudaPool`."""

    def __init__(self, descriptor: PoolDescriptor, device: int | None) -> None:
        import torch

        share = _unpack_share(descriptor.handle)
        self.descriptor = descriptor
        try:
            dev = torch.cuda.current_device() if device is None else device
            with torch.cuda.device(dev):
                storage = torch.UntypedStorage._new_shared_cuda(dev, *share[1:])
        except RuntimeError as exc:
            raise IpcError(
                f"cannot open CUDA IPC pool {descriptor.pool_id} of rank {descriptor.owner}: {exc}",
                pool_id=descriptor.pool_id,
            ) from exc
        if storage.nbytes() != descriptor.segment_bytes:
            raise IpcError(
                f"CUDA IPC pool {descriptor.pool_id} maps {storage.nbytes()} bytes, "
                f"descriptor says {descriptor.segment_bytes}",
                pool_id=descriptor.pool_id,
            )
        self._storage: Any = storage
        base = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", dev))
        self._base: Any = base.set_(storage, 0, (storage.nbytes(),), (1,))
        self.words = _TensorWords(
            self._base[: descriptor.data_start].view(torch.int32), 1 + descriptor.ack_words
        )

    def view(self, offset: int, nbytes: int) -> Any:
        return self._base[offset : offset + nbytes]

    def close(self) -> None:
        import torch

        if self._base is not None:
            # Acks are queued on this process's stream; they must land before unmapping.
            torch.cuda.current_stream(self._base.device).synchronize()
        # torch closes the IPC handle when the last storage built from it dies; views
        # a caller still holds keep it mapped until then.
        self._base = None
        self._storage = None
