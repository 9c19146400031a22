"""The few CUDA driver calls the GPU backend makes, through NVIDIA's ``cuda-python``
bindings (``cuda.bindings.driver``), with every status translated into
:class:`~distcache.errors.IpcError` at this boundary.

Every call runs with the device's primary context pushed and popped again, the
context torch's runtime uses, so distcache neither creates a context of its own nor
leaves the calling thread's current context changed. The bindings are imported on
first use: ``import distcache.ipc`` loads neither them nor the driver.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from distcache.errors import IpcError

IPC_HANDLE_BYTES = 64
UUID_BYTES = 16


@functools.cache
def driver() -> Any:
    """``cuda.bindings.driver`` after ``cuInit``.

    Raises:
        IpcError: cuda-python is missing or the driver cannot be loaded/initialised.
    """
    try:
        from cuda.bindings import driver as drv  # type: ignore[import-untyped]
    except ImportError as exc:
        raise IpcError(f"cuda-python is not installed ({exc}); pip install cuda-python") from exc
    try:
        check(drv.cuInit(0), "cuInit")
    except IpcError:
        raise
    except Exception as exc:  # the driver library itself is missing (no NVIDIA driver)
        raise IpcError(f"the CUDA driver cannot be loaded: {exc}") from exc
    return drv


def check(result: tuple[Any, ...], what: str) -> Any:
    """The value(s) of a binding call, or an :class:`IpcError` naming the call."""
    status, *values = result
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise IpcError(f"{what} failed: {name} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def _primary(ordinal: int) -> Any:
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    # Retained for the life of the process: it is torch's context too.
    return check(drv.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({ordinal})")


@contextmanager
def on_device(ordinal: int) -> Iterator[Any]:
    """Run driver calls in ``ordinal``'s primary context; yields the bindings."""
    drv = driver()
    check(drv.cuCtxPushCurrent(_primary(ordinal)), "cuCtxPushCurrent")
    try:
        yield drv
    finally:
        check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def device_count() -> int:
    return int(check(driver().cuDeviceGetCount(), "cuDeviceGetCount"))


def device_uuid(ordinal: int) -> bytes:
    """The device's UUID: the same GPU has the same UUID whatever a process's
    ``CUDA_VISIBLE_DEVICES`` numbering."""
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    uuid = check(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid")
    return bytes(uuid.bytes)[:UUID_BYTES]


def ordinal_of(uuid: bytes) -> int | None:
    """The visible device with this UUID, or None when this process cannot see it."""
    for ordinal in range(device_count()):
        if device_uuid(ordinal) == uuid:
            return ordinal
    return None


def attribute(ordinal: int, name: str) -> int:
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    attr = getattr(drv.CUdevice_attribute, name)
    return int(check(drv.cuDeviceGetAttribute(attr, dev), f"cuDeviceGetAttribute({name})"))


def can_access_peer(ordinal: int, peer: int) -> bool:
    if ordinal == peer:
        return True
    drv = driver()
    dev = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    other = check(drv.cuDeviceGet(peer), "cuDeviceGet")
    return bool(check(drv.cuDeviceCanAccessPeer(dev, other), "cuDeviceCanAccessPeer"))


def mem_alloc(ordinal: int, nbytes: int) -> int:
    with on_device(ordinal) as drv:
        return int(check(drv.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))


def mem_free(ordinal: int, ptr: int) -> None:
    with on_device(ordinal) as drv:
        check(drv.cuMemFree(drv.CUdeviceptr(ptr)), "cuMemFree")


def ipc_handle(ordinal: int, ptr: int) -> bytes:
    """The 64-byte IPC handle of allocation ``ptr`` (from :func:`mem_alloc`)."""
    with on_device(ordinal) as drv:
        handle = check(drv.cuIpcGetMemHandle(drv.CUdeviceptr(ptr)), "cuIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def ipc_open(ordinal: int, handle: bytes) -> int:
    """Map a peer's allocation into ``ordinal``'s context (peer access enabled lazily
    when the memory lives on another device)."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise IpcError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    with on_device(ordinal) as drv:
        native = drv.CUipcMemHandle()
        ctypes.memmove(native.getPtr(), handle, IPC_HANDLE_BYTES)
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return int(check(drv.cuIpcOpenMemHandle(native, int(flags)), "cuIpcOpenMemHandle"))


def ipc_close(ordinal: int, ptr: int) -> None:
    with on_device(ordinal) as drv:
        check(drv.cuIpcCloseMemHandle(drv.CUdeviceptr(ptr)), "cuIpcCloseMemHandle")


def host_register(ordinal: int, address: int, nbytes: int) -> int:
    """Page-lock host memory for the device and return its device address (what
    stream memory operations take)."""
    with on_device(ordinal) as drv:
        flags = int(drv.CU_MEMHOSTREGISTER_PORTABLE) | int(drv.CU_MEMHOSTREGISTER_DEVICEMAP)
        check(drv.cuMemHostRegister(address, nbytes, flags), "cuMemHostRegister")
        return int(check(drv.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))


def host_unregister(ordinal: int, address: int) -> None:
    with on_device(ordinal) as drv:
        check(drv.cuMemHostUnregister(address), "cuMemHostUnregister")


def stream_write(ordinal: int, stream: int, address: int, value: int) -> None:
    """Queue ``*address = value`` on ``stream``, after a fence over the stream's earlier
    writes (the default flags keep the memory barrier)."""
    with on_device(ordinal) as drv:
        flags = int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        check(
            drv.cuStreamWriteValue32(drv.CUstream(stream), drv.CUdeviceptr(address), value, flags),
            "cuStreamWriteValue32",
        )


def stream_wait(ordinal: int, stream: int, address: int, value: int) -> None:
    """Make work queued next on ``stream`` wait until ``*address == value``."""
    with on_device(ordinal) as drv:
        flags = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
        check(
            drv.cuStreamWaitValue32(drv.CUstream(stream), drv.CUdeviceptr(address), value, flags),
            "cuStreamWaitValue32",
        )


def synchronize(ordinal: int) -> None:
    with on_device(ordinal) as drv:
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")


def stream_synchronize(ordinal: int, stream: int) -> None:
    with on_device(ordinal) as drv:
        check(drv.cuStreamSynchronize(drv.CUstream(stream)), "cuStreamSynchronize")


def buffer_address(buffer: Any) -> int:
    """The address of a writable buffer (an ``mmap``); the export is dropped at once."""
    view = (ctypes.c_char * 1).from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def device_tensor(ptr: int, nbytes: int, owner: Any, ordinal: int) -> Any:
    """A uint8 torch tensor over ``nbytes`` of device memory at ``ptr`` (no copy); it
    keeps ``owner`` alive as long as any view of it lives."""
    import torch

    return torch.as_tensor(DeviceArray(ptr, nbytes, owner), device=torch.device("cuda", ordinal))


class DeviceArray:
    """``nbytes`` of device memory at ``ptr`` as a ``__cuda_array_interface__`` object:
    ``torch.as_tensor(array, device=...)`` views it without copying, and keeps the
    array (and ``owner``, whose lifetime is the memory's) alive while any view is."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }
