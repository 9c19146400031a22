"""fetch and view, declared readers, consumers that leave or die, and producers
outside the group: on host shared memory, within one process and across processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from distcache.errors import IpcError
from distcache.ipc import PoolDescriptor, PoolRegistry, ShmPool
from tests.support.ipc_pools import pool_fixtures
from tests.support.process import kill_group

pool, readers = pool_fixtures()


def test_fetch_copies_then_acks_so_the_result_outlives_the_lease(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    source = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    ref = pool.put(source)
    assert ref is not None
    got = {rank: registry.fetch(ref) for rank, registry in readers.items()}
    assert pool.reclaim() == 1  # both acked by fetch
    again = pool.put(torch.full((4, 6), -1.0))  # reuses the range
    assert again is not None and again.offset == ref.offset
    for tensor in got.values():
        assert torch.equal(tensor, source) and tensor.is_contiguous()


def test_fetch_into_out_and_a_mismatched_out_acks_nothing(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    ref = pool.put(torch.arange(8, dtype=torch.int64))
    assert ref is not None
    with pytest.raises(IpcError, match="shape"):
        readers[1].fetch(ref, out=torch.empty(9, dtype=torch.int64))
    with pytest.raises(IpcError, match="dtype"):
        readers[1].fetch(ref, out=torch.empty(8, dtype=torch.int32))
    out = torch.zeros(8, dtype=torch.int64)
    assert readers[1].fetch(ref, out=out) is out
    assert out.tolist() == list(range(8))
    readers[2].fetch(ref)
    assert pool.reclaim() == 1


def test_only_the_declared_reader_reads_and_its_ack_alone_frees_the_lease(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    ref = pool.put(torch.ones(16), consumers=[2])
    assert ref is not None
    with pytest.raises(IpcError, match="not declared for rank 1"):
        readers[1].fetch(ref)
    with pytest.raises(IpcError, match="not declared"):
        readers[1].resolve(ref)
    assert pool.reclaim() == 0
    assert readers[2].fetch(ref).tolist() == [1.0] * 16
    assert pool.reclaim() == 1 and pool.in_flight == 0


def test_a_feature_is_acknowledged_once_and_never_read_after(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    ref = pool.put(torch.ones(4), consumers=[1])
    assert ref is not None
    readers[1].fetch(ref)
    for call in (readers[1].fetch, readers[1].resolve, readers[1].ack):
        with pytest.raises(IpcError, match="already acknowledged"):
            call(ref)


def test_view_is_zero_copy_and_acks_at_exit(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    ref = pool.put(torch.arange(6, dtype=torch.int32), consumers=[1])
    assert ref is not None
    with readers[1].view(ref) as t:
        assert t.tolist() == list(range(6))
        assert pool.reclaim() == 0  # not acked while inside the block
    assert pool.reclaim() == 1
    with pytest.raises(IpcError):
        readers[1].resolve(ref)


@pytest.mark.parametrize("consumers", [[], [0], [3], ["x"]])
def test_put_refuses_readers_that_are_not_consumers(pool: ShmPool, consumers: list) -> None:
    with pytest.raises(IpcError, match="reader"):
        pool.put(torch.ones(2), consumers=consumers)
    assert pool.in_flight == 0


def test_a_consumer_that_leaves_releases_its_leases(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    both = pool.put(torch.ones(4))
    mine = pool.put(torch.ones(4), consumers=[2])
    assert both is not None and mine is not None
    readers[1].fetch(both)
    assert pool.reclaim() == 0
    assert pool.holders() == [1, 2]
    readers[2].close()
    assert pool.holders() == [1]
    assert pool.reclaim() == 2
    assert pool.free_bytes == pool.capacity


CONSUMER = """
import sys
from distcache.ipc import PoolRegistry
registry = PoolRegistry(int(sys.argv[1]))
registry.add(sys.stdin.buffer.read())
print("mapped", flush=True)
sys.stdin.close()
import time
time.sleep(600)
"""


def test_a_consumer_that_dies_releases_its_leases_and_the_producer_never_blocks(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    readers[2].close()  # rank 2 will be the dying process instead
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, "2"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pool.descriptor().pack())
        proc.stdin.close()
        assert proc.stdout.readline() == b"mapped\n"
        ref = pool.put(torch.ones(4), consumers=[2])
        assert ref is not None
        assert pool.reclaim() == 0  # alive, unacked: held
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        started = time.monotonic()
        assert pool.reclaim() == 1
        assert time.monotonic() - started < 1.0
    finally:
        kill_group(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_producer_outside_the_group_is_mapped_once_from_bytes_and_unlinks_when_all_mapped() -> (
    None
):
    with ShmPool(1 << 16, slots=8) as outside:
        outside.bind(owner=None, consumers=[0, 1])
        packed = outside.descriptor().pack()
        assert PoolDescriptor.unpack(packed).owner is None
        registries = [PoolRegistry(rank) for rank in (0, 1)]
        try:
            for registry in registries:
                registry.add(packed)
                registry.add(packed)
                assert registry.opens == {outside.pool_id: 1}
            ref = outside.put(torch.arange(5), consumers=[0])
            assert ref is not None
            assert not os.path.exists(outside.path)  # every consumer mapped: unlinked
            assert registries[0].fetch(ref).tolist() == list(range(5))
            assert outside.reclaim() == 1
        finally:
            for registry in registries:
                registry.close()
