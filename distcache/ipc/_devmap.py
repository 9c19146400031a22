"""The consumer side of the GPU backend: one peer pool's device memory mapped with
``cuIpcOpenMemHandle`` and its control words registered with the device, plus the
backend part of the pool descriptor (design: :mod:`distcache.ipc._cuda`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import weakref
from collections.abc import Callable
from typing import Any

from distcache._log import get_logger
from distcache.errors import IpcError
from distcache.ipc import _driver as drv
from distcache.ipc._descriptor import PoolDescriptor
from distcache.ipc._layout import WORD_BYTES, Layout, WordArray, in_process
from distcache.ipc._probe import resolve_device
from distcache.ipc._shm import open_segment

log = get_logger(__name__)

# ipc handle, device uuid, data bytes, control-word segment bytes, segment name length
_HANDLE = struct.Struct(f"<{drv.IPC_HANDLE_BYTES}s{drv.UUID_BYTES}sQQH")


def pack_handle(ipc: bytes, uuid: bytes, nbytes: int, words_bytes: int, segment: str) -> bytes:
    """The backend part of a CUDA pool's descriptor."""
    name = segment.encode()
    return _HANDLE.pack(ipc, uuid, nbytes, words_bytes, len(name)) + name


def unpack_handle(data: bytes) -> tuple[bytes, bytes, int, int, str]:
    """Inverse of :func:`pack_handle`.

    Raises:
        IpcError: the bytes are truncated, padded or not ASCII.
    """
    try:
        ipc, uuid, nbytes, words_bytes, n = _HANDLE.unpack_from(data)
        if len(data) != _HANDLE.size + n:
            raise IpcError(
                f"CUDA pool handle is {len(data)} bytes, its fields say {_HANDLE.size + n}"
            )
        segment = data[_HANDLE.size :].decode("ascii")
    except (struct.error, UnicodeDecodeError) as exc:
        raise IpcError(f"garbled CUDA pool handle ({exc})") from None
    return ipc, uuid, nbytes, words_bytes, segment


def stream_handle(stream: Any, ordinal: int) -> int:
    import torch

    if stream is None:
        stream = torch.cuda.current_stream(ordinal)
    return int(stream.cuda_stream)


class _Peer:
    """The lifetime of one consumer mapping: views keep it alive; when the last one
    dies, its finalizer unmaps the device memory, then marks the consumer ``LEFT``
    (if the registry closed it), then releases the control words."""

    def __init__(self, ordinal: int, ptr: int, mm: mmap.mmap, addr: int, words: WordArray) -> None:
        self.leave: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(  # not in a forked child: not its mapping
            self, in_process, os.getpid(), _close_peer, ordinal, ptr, mm, addr, words, self.leave
        )


def _close_peer(
    ordinal: int,
    ptr: int,
    mm: mmap.mmap,
    addr: int,
    words: WordArray,
    leave: list[Callable[[], None]],
) -> None:
    try:
        drv.ipc_close(ordinal, ptr)
    except IpcError as exc:
        log.warning("closing a CUDA IPC mapping failed: %s", exc)
    for callback in leave:
        callback()
    words.release()
    with contextlib.suppress(IpcError):
        drv.host_unregister(ordinal, addr)
    try:
        mm.close()
    except BufferError:  # a caller still holds a view of the control words
        log.warning("CUDA pool control words stay mapped until their last view is freed")


class CudaMapping:
    """A consumer's one mapping of a peer's :class:`CudaPool`, on ``device`` (the
    consumer's own device; peer access is enabled when the pool lives on another)."""

    host_ready = False

    def __init__(self, descriptor: PoolDescriptor, device: int | None) -> None:
        import torch

        ipc, _uuid, nbytes, words_bytes, segment = unpack_handle(descriptor.handle)
        if nbytes != descriptor.capacity or words_bytes < descriptor.data_start:
            raise IpcError(
                f"CUDA pool {descriptor.pool_id}: handle says {nbytes} data bytes and "
                f"{words_bytes} control bytes, descriptor {descriptor.capacity} and "
                f"{descriptor.data_start}",
                pool_id=descriptor.pool_id,
            )
        self.descriptor = descriptor
        ordinal = resolve_device(device)
        self._ordinal = ordinal
        self.device = torch.device("cuda", ordinal)
        mm = open_segment(segment, words_bytes, descriptor)
        words = WordArray(
            memoryview(mm)[: descriptor.data_start],
            Layout(descriptor.slots, descriptor.ack_words).stride,
        )
        try:
            addr = drv.buffer_address(mm)
            self._dev_words = drv.host_register(ordinal, addr, words_bytes)
            try:
                ptr = drv.ipc_open(ordinal, ipc)
            except BaseException:
                drv.host_unregister(ordinal, addr)
                raise
        except IpcError as exc:
            words.release()
            mm.close()
            raise IpcError(
                f"cannot map CUDA pool {descriptor.pool_id} on cuda:{ordinal}: {exc}",
                pool_id=descriptor.pool_id,
            ) from exc
        self.words = words
        self._peer: _Peer | None = _Peer(ordinal, ptr, mm, addr, words)
        self._data: Any = drv.device_tensor(ptr, nbytes, self._peer, ordinal)

    def view(self, offset: int, nbytes: int) -> Any:
        start = offset - self.descriptor.data_start
        return self._data[start : start + nbytes]

    def order_ready(self, index: int, generation: int, stream: Any) -> None:
        drv.stream_wait(
            self._ordinal, stream_handle(stream, self._ordinal),
            self._dev_words + WORD_BYTES * index, generation,
        )  # fmt: skip

    def write_ack(self, index: int, generation: int, stream: Any) -> None:
        drv.stream_write(
            self._ordinal, stream_handle(stream, self._ordinal),
            self._dev_words + WORD_BYTES * index, generation,
        )  # fmt: skip

    def settle(self) -> None:
        drv.synchronize(self._ordinal)

    def close(self, leave: Callable[[], None] | None = None) -> None:
        """Drop this mapping's references; the device memory is unmapped, and then
        ``leave`` runs, when the last view of it dies."""
        if self._peer is not None:
            if leave is not None:
                self._peer.leave.append(leave)
            self._peer = None
            self._data = None
