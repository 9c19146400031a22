"""ShmPool: host shared memory across real processes, reservation, leases."""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from distcache.errors import IpcError, PoolError
from distcache.ipc import FeatureRef, PoolDescriptor, PoolRegistry, ShmPool
from distcache.ipc import _shm as shm_module
from distcache.ipc._shm import ShmMapping

CHILD_TIMEOUT = 60.0


def _consumer(conn: Connection) -> None:
    """Rank 1 in a spawned process: map the pool once, resolve, write through, ack."""
    os.setsid()  # own process group, so the parent can kill everything it started
    registry = PoolRegistry(rank=1)
    registry.add(PoolDescriptor.unpack(conn.recv_bytes()))
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            break
        ref = FeatureRef.unpack(data)
        view = registry.resolve(ref)
        conn.send((view.tolist(), registry.opens))
        view.view(-1)[0] = -1  # zero-copy: the producer sees this write
        del view
        registry.ack(ref)
        conn.send("acked")
    registry.close()
    conn.send("closed")


@pytest.fixture
def consumer() -> Any:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,), daemon=True)
    proc.start()
    try:
        yield parent
    finally:
        proc.join(CHILD_TIMEOUT)
        if proc.is_alive():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join(5)
            pytest.fail("consumer process did not finish in time")
        assert proc.exitcode == 0


def _recv(conn: Connection) -> Any:
    if not conn.poll(CHILD_TIMEOUT):
        raise TimeoutError("consumer process did not answer")
    return conn.recv()


def test_consumer_process_resolves_values_zero_copy_and_acks(consumer: Connection) -> None:
    pool = ShmPool(1 << 16, consumers=[1], name="spawned")
    pool.bind(owner=0, consumers=[1])
    producer_view = ShmMapping(pool.descriptor())  # the producer's own eye on the segment
    consumer.send_bytes(pool.descriptor().pack())
    for i in range(5):
        tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * i
        ref = pool.put(tensor)
        assert ref is not None
        consumer.send_bytes(ref.pack())
        values, opens = _recv(consumer)
        assert values == tensor.tolist()
        assert opens == {"spawned": 1}
        assert _recv(consumer) == "acked"
        seen = producer_view.view(ref.offset, ref.nbytes).view(torch.float32)
        assert seen[0].item() == -1.0
        del seen
    assert pool.reclaim() == 5
    assert pool.in_flight == 0
    consumer.send_bytes(b"stop")
    assert _recv(consumer) == "closed"
    producer_view.close()
    pool.close()
    assert not os.path.exists(pool.path)


def test_pool_larger_than_free_dev_shm_fails_at_creation() -> None:
    stat = os.statvfs(shm_module.SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    before = set(os.listdir(shm_module.SHM_DIR))
    with pytest.raises(PoolError) as info:
        ShmPool(free + (1 << 30), name="too-big")
    assert isinstance(info.value, OSError)
    assert "--shm-size" in str(info.value)
    assert set(os.listdir(shm_module.SHM_DIR)) - before == set()


def test_failed_reservation_is_an_oserror_and_leaves_no_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_module.os, "posix_fallocate", no_space)
    before = set(os.listdir(shm_module.SHM_DIR))
    with pytest.raises(PoolError, match="reserve"):
        ShmPool(1 << 16, name="nospace")
    assert set(os.listdir(shm_module.SHM_DIR)) - before == set()


def test_segment_is_fully_reserved_at_creation() -> None:
    with ShmPool(1 << 20, consumers=[1]) as pool:
        st = os.stat(pool.path)
        assert st.st_size == pool.data_start + pool.capacity
        assert st.st_blocks * 512 >= st.st_size  # pages allocated, not sparse


def test_full_pool_answers_none_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    with ShmPool(1024, consumers=[1]) as pool:
        pool.bind(0, [1])
        assert pool.put(torch.zeros(256, dtype=torch.uint8)) is not None
        with caplog.at_level(logging.DEBUG, logger="distcache.ipc._producer"):
            for _ in range(5):
                assert pool.put(torch.zeros(1024, dtype=torch.uint8)) is None
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "full" in warnings[0].getMessage()
        assert pool.full_count == 5


def test_cancelled_lease_is_reusable_at_once() -> None:
    with ShmPool(256, consumers=[1]) as pool:
        pool.bind(0, [1])
        ref = pool.put(torch.ones(64))
        assert ref is not None
        pool.cancel(ref)
        assert pool.put(torch.ones(64)) is not None
        with pytest.raises(IpcError):
            pool.cancel(ref)


def test_put_rejects_non_contiguous_and_unsupported_tensors() -> None:
    with ShmPool(4096, consumers=[1]) as pool:
        pool.bind(0, [1])
        with pytest.raises(IpcError, match="contiguous"):
            pool.put(torch.zeros(4, 4).t())
        with pytest.raises(IpcError):
            pool.put([1, 2, 3])


def test_put_before_exchange_without_consumers_raises() -> None:
    with ShmPool(4096) as pool, pytest.raises(IpcError, match="exchange"):
        pool.put(torch.zeros(4))


def test_owner_cannot_be_its_own_consumer() -> None:
    with ShmPool(4096, consumers=[0, 1]) as pool, pytest.raises(IpcError, match="own pool"):
        pool.bind(0, [])


def test_close_is_idempotent_unlinks_and_forbids_use() -> None:
    pool = ShmPool(4096, consumers=[1])
    pool.bind(0, [1])
    assert os.path.exists(pool.path)
    pool.close()
    pool.close()
    assert not os.path.exists(pool.path)
    with pytest.raises(IpcError, match="closed"):
        pool.put(torch.zeros(1))


def test_unlinked_pool_keeps_serving_mapped_consumers() -> None:
    with ShmPool(4096, consumers=[1], name="unlinked") as pool:
        pool.bind(0, [1])
        registry = PoolRegistry(rank=1)
        registry.add(pool.descriptor())
        pool.unlink()
        assert not os.path.exists(pool.path)
        ref = pool.put(torch.arange(5))
        assert ref is not None
        with registry.view(ref) as view:
            assert view.tolist() == [0, 1, 2, 3, 4]
        registry.close()


def test_mapping_rejects_a_descriptor_whose_size_does_not_match() -> None:
    with ShmPool(4096, consumers=[1], name="sized") as pool:
        pool.bind(0, [1])
        desc = pool.descriptor()
        forged = PoolDescriptor.unpack(
            desc.pack().replace(
                desc.capacity.to_bytes(8, "little"), (desc.capacity * 2).to_bytes(8, "little"), 1
            )
        )
        assert forged.capacity == 2 * desc.capacity
        with pytest.raises(IpcError, match="bytes"):
            ShmMapping(forged)


def test_mapping_rejects_a_handle_that_is_not_a_segment_name() -> None:
    with ShmPool(4096, consumers=[1], name="named") as pool:
        pool.bind(0, [1])
        desc = pool.descriptor()
        fields = {f: getattr(desc, f) for f in desc.__dataclass_fields__}
        fields["handle"] = b"../../etc/passwd"
        with pytest.raises(IpcError, match="segment name"):
            ShmMapping(PoolDescriptor(**fields))
