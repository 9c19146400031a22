"""The CUDA pool's Python logic on a fake driver: device memory is host memory, a
stream is a list of operations that run at once, in order. What this checks is the
order of the operations (copy, then ready word; wait, copy, then ack), that nothing on
the serving path synchronizes, and the teardown order. Whether the real driver does
what the fake does is for scripts/gpu_check.sh on a GPU machine: this is not CUDA."""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from distcache.errors import IpcError
from distcache.ipc import CudaPool, PoolRegistry, _cuda, _devmap, _driver


class FakeDriver:
    def __init__(self) -> None:
        self.memory: dict[int, Any] = {}
        self.calls: list[tuple[str, Any]] = []
        self.open: set[int] = set()
        self.registered: set[int] = set()  # host addresses registered with the device
        self.refuse_register = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def mem_alloc(ordinal: int, nbytes: int) -> int:
            buf = (ctypes.c_uint8 * nbytes)()
            ptr = ctypes.addressof(buf)
            self.memory[ptr] = buf
            return ptr

        def mem_free(ordinal: int, ptr: int) -> None:
            self.calls.append(("free", ptr))
            del self.memory[ptr]

        def ipc_open(ordinal: int, handle: bytes) -> int:
            ptr = int.from_bytes(handle[:8], "little")
            self.open.add(ptr)
            self.calls.append(("open", ptr))
            return ptr

        def ipc_close(ordinal: int, ptr: int) -> None:
            self.open.discard(ptr)
            self.calls.append(("close", ptr))

        def stream_write(ordinal: int, stream: int, address: int, value: int) -> None:
            self.calls.append(("write", (address, value)))
            ctypes.c_uint32.from_address(address).value = value

        def stream_wait(ordinal: int, stream: int, address: int, value: int) -> None:
            # In order: the producer's ready write ran before this wait was queued.
            assert ctypes.c_uint32.from_address(address).value == value
            self.calls.append(("wait", (address, value)))

        def device_tensor(ptr: int, nbytes: int, owner: Any, ordinal: int) -> Any:
            buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
            tensor = torch.frombuffer(buf, dtype=torch.uint8)
            # As torch.as_tensor does with __cuda_array_interface__: views keep the
            # owner (and so the mapping) alive.
            tensor._owner = owner  # type: ignore[attr-defined]
            return tensor

        def host_register(ordinal: int, address: int, nbytes: int) -> int:
            if self.refuse_register:
                raise IpcError("cuMemHostRegister failed: CUDA_ERROR_NOT_PERMITTED (800)")
            assert address not in self.registered, "HOST_MEMORY_ALREADY_REGISTERED"
            self.registered.add(address)
            return address

        def host_unregister(ordinal: int, address: int) -> None:
            self.calls.append(("unregister", address))
            self.registered.remove(address)

        fakes = {
            "mem_alloc": mem_alloc,
            "mem_free": mem_free,
            "ipc_handle": lambda ordinal, ptr: ptr.to_bytes(8, "little") + bytes(56),
            "ipc_open": ipc_open,
            "ipc_close": ipc_close,
            "host_register": host_register,
            "host_unregister": host_unregister,
            "device_uuid": lambda ordinal: bytes(16),
            "stream_write": stream_write,
            "stream_wait": stream_wait,
            "device_tensor": device_tensor,
            "synchronize": lambda ordinal: self.calls.append(("sync", ordinal)),
            "stream_synchronize": lambda o, s: self.calls.append(("sync", s)),
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(_driver, name, fake)
        for module in (_cuda, _devmap):
            monkeypatch.setattr(module, "stream_handle", lambda stream, ordinal: 7)
        monkeypatch.setattr(_devmap, "resolve_device", lambda device: 0)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def since(self, mark: int) -> list[str]:
        return [name for name, _ in self.calls[mark:]]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    driver = FakeDriver()
    driver.install(monkeypatch)
    monkeypatch.setattr(CudaPool, "_check_tensor", lambda self, tensor: None)
    yield driver


def _consumer(pool: CudaPool, rank: int) -> PoolRegistry:
    registry = PoolRegistry(rank, device=0)
    registry.add(pool.descriptor().pack())
    # The fake's "device memory" is host memory: fetch allocates its result there.
    registry._entries[pool.pool_id].mapping.device = torch.device("cpu")  # type: ignore[misc]
    return registry


def test_put_queues_copy_then_ready_and_fetch_queues_wait_copy_then_ack(fake: FakeDriver) -> None:
    pool = CudaPool(1 << 16, 0, slots=8, name="fakegpu")
    pool.bind(owner=None, consumers=[1, 2])
    readers = {rank: _consumer(pool, rank) for rank in (1, 2)}
    assert [name for name, _ in fake.calls] == ["open", "open"]
    mark = len(fake.calls)
    source = torch.arange(64, dtype=torch.float32)
    ref = pool.put(source, consumers=[2])
    assert ref is not None
    assert fake.since(mark) == ["write"]  # the ready word, after the copy; no sync
    mark = len(fake.calls)
    got = readers[2].fetch(ref)
    assert fake.since(mark) == ["wait", "write"]  # wait ready, (copy), ack; no sync
    assert torch.equal(got, source)
    assert fake.calls[-2][1][1] == fake.calls[-1][1][1] == ref.generation
    assert pool.reclaim() == 1
    ref = pool.put(source * 2)
    assert ref is not None
    with readers[1].view(ref) as t:
        assert torch.equal(t, source * 2)
        assert pool.reclaim() == 0
    readers[2].fetch(ref)
    assert pool.reclaim() == 1
    assert "sync" not in [name for name, _ in fake.calls]
    for registry in readers.values():
        registry.close()
    del t
    pool.close()
    # Consumers unmapped before the producer freed; the producer freed only then.
    names = [name for name, _ in fake.calls]
    assert names.count("close") == 2 and names.index("free") > max(
        i for i, n in enumerate(names) if n == "close"
    )


def test_a_producer_never_frees_memory_a_consumer_still_maps(
    fake: FakeDriver, caplog: pytest.LogCaptureFixture
) -> None:
    pool = CudaPool(1 << 16, 0, slots=8, name="heldgpu", teardown_timeout=0.2)
    pool.bind(owner=None, consumers=[1])
    registry = _consumer(pool, 1)
    with caplog.at_level(logging.WARNING, logger="distcache.ipc._cuda"):
        pool.close()
    assert "still map it" in caplog.text
    assert "free" not in [name for name, _ in fake.calls]
    # The producer's own control words go: their mapping and, with it, their
    # registration (left registered, the next mapping at that address would fail).
    assert ("unregister", pool._addr) in fake.calls
    registry.close()
    assert fake.registered == set()


def test_a_pool_that_cannot_be_exported_serves_host_memory_once_bound(
    fake: FakeDriver, caplog: pytest.LogCaptureFixture
) -> None:
    # A producer that binds its pool itself (outside any exchange, after a restart):
    # no probe votes, so the pool falls back at bind rather than failing its first put.
    fake.refuse_register = True
    with caplog.at_level(logging.WARNING, logger="distcache.ipc._cuda"):
        pool = CudaPool(1 << 16, 0, slots=8, name="unexported")
        assert "NOT_PERMITTED" in pool.unusable
        pool.bind(owner=None, consumers=[1])
    assert pool.backend == "shm" and pool.descriptor().backend == "shm"
    assert "shared through host shared memory" in caplog.text
    assert "free" in [name for name, _ in fake.calls]  # its device memory went at once
    ref = pool.put(torch.ones(4))
    assert ref is not None
    registry = PoolRegistry(1)
    registry.add(pool.descriptor().pack())
    assert torch.equal(registry.fetch(ref), torch.ones(4))
    registry.close()
    pool.close()


def test_cancel_waits_for_the_queued_copy_before_the_range_is_reused(fake: FakeDriver) -> None:
    pool = CudaPool(1 << 16, 0, slots=8, name="cancelgpu")
    pool.bind(owner=None, consumers=[1])
    ref = pool.put(torch.ones(4))
    assert ref is not None
    mark = len(fake.calls)
    pool.cancel(ref)
    assert fake.since(mark) == ["sync"]
    assert pool.in_flight == 0
    pool.close()
