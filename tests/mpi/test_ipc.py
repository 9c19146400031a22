"""IPC pools across real processes, under ``mpirun -n N`` (MPI or torch communicator).

Every rank owns a pool; the registry maps each peer pool once; features travel as
packed refs over the communicator. Pools are host shared memory, or CUDA IPC pools
when ``DISTCACHE_TEST_IPC_BACKEND=cuda`` (``scripts/gpu_check.sh`` on a GPU machine).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from distcache.comm import Communicator
from distcache.errors import IpcError, StaleHandleError
from distcache.ipc import CudaPool, FeatureRef, PoolRegistry, ShmPool
from distcache.ipc._producer import ProducerPool
from distcache.ipc._shm import SHM_DIR
from tests.support.ipc_exchange import FEATURES, run_exchange

pytestmark = pytest.mark.mpi(min_size=2)

BURST = 64
DTYPES = (torch.float32, torch.int64, torch.bfloat16, torch.uint8)


def _prefix(shared_tmp: Path) -> str:
    # One prefix per test run, identical on every rank: pool ids cannot collide with
    # another job's on the same machine.
    return "mpi" + shared_tmp.name.replace("distcache-mpi-", "")


def _feature(rank: int, i: int) -> torch.Tensor:
    dtype = DTYPES[i % len(DTYPES)]
    rows = 1 + (rank + i) % 7
    values = torch.arange(rows * 33, dtype=torch.float32).reshape(rows, 33) + rank * 1000 + i
    return values.remainder(250).to(dtype)


def _device(comm: Communicator) -> torch.device:
    if os.environ.get("DISTCACHE_TEST_IPC_BACKEND", "shm") != "cuda":
        return torch.device("cpu")
    index = comm.rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _pool(comm: Communicator, capacity: int, name: str) -> ProducerPool:
    device = _device(comm)
    if device.type == "cuda":
        # A short teardown wait: the restart case closes a pool its consumers still map.
        return CudaPool(capacity, device, name=name, teardown_timeout=1.0)
    return ShmPool(capacity, name=name)


def _leftovers(prefix: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"distcache.{prefix}")]


def test_burst_between_all_ranks_maps_each_pool_once_and_frees_on_ack(
    comm: Communicator, shared_tmp: Path
) -> None:
    prefix = _prefix(shared_tmp)
    pool = _pool(comm, 4 << 20, f"{prefix}-r{comm.rank}")
    device = _device(comm)
    registry = PoolRegistry.exchange(comm, [pool], timeout=120)
    try:
        assert registry.backend == ("cuda" if device.type == "cuda" else "shm")
        if isinstance(pool, ShmPool):
            assert not os.path.exists(pool.path), "owner did not unlink after the exchange"
        assert pool.consumers == tuple(r for r in range(comm.size) if r != comm.rank)
        refs = []
        for i in range(BURST):
            ref = pool.put(_feature(comm.rank, i).to(device))
            assert ref is not None
            refs.append(ref.pack())
        everyone = comm.allgather_object(refs, timeout=120)
        for src, packed in enumerate(everyone):
            if src == comm.rank:
                continue
            for i, data in enumerate(packed):
                with registry.view(FeatureRef.unpack(data)) as t:
                    expected = _feature(src, i)
                    assert t.device == device, t.device
                    assert t.dtype == expected.dtype and torch.equal(t.cpu(), expected), (src, i)
        expected_opens = {f"{prefix}-r{r}": 1 for r in range(comm.size) if r != comm.rank}
        assert registry.opens == expected_opens
        comm.barrier(timeout=120)  # every consumer has acked every feature
        assert pool.reclaim() == BURST
        assert pool.in_flight == 0
        assert pool.free_bytes == pool.capacity
        # A second burst reuses the freed ranges; still no new mapping.
        again = pool.put(_feature(comm.rank, 0).to(device))
        assert again is not None
        pool.cancel(again)
        assert registry.opens == expected_opens
    finally:
        registry.close()
        registry.close()
        comm.barrier(timeout=120)
        pool.close()
    comm.barrier(timeout=120)
    assert _leftovers(prefix) == []


def test_one_producer_feeds_10000_features_intact_and_recycles_slots_only_after_all_acks(
    comm: Communicator, shared_tmp: Path
) -> None:
    # Rank 0 produces; the last rank is a slow consumer that holds a whole small pool
    # (the producer gets "no lease" at once) and lags one batch on the bulk pool; the
    # others resolve and ack without waiting for it. Forged, out-of-bounds and stale
    # refs are refused on every consumer. (The scenario asserts as it goes.)
    prefix = _prefix(shared_tmp)
    everyone = run_exchange(comm, _device(comm), prefix)
    producer, consumers = everyone[0], everyone[1:]
    assert producer["sent"] == producer["reclaimed"] == FEATURES
    assert producer["opens"] == {} and producer["no_lease"] == 4
    for consumer in consumers:
        assert consumer["verified"] == consumer["acked"] == FEATURES
        assert consumer["sha256"] == producer["sha256"]
        assert consumer["opens"] == {f"{prefix}-bulk": 1, f"{prefix}-tight": 1}
        assert consumer["forged_refused"] == 24
    assert [c["role"] for c in consumers] == ["fast"] * (comm.size - 2) + ["slow"]
    comm.barrier(timeout=120)
    assert _leftovers(prefix) == []


def test_registry_use_after_close_raises(comm: Communicator, shared_tmp: Path) -> None:
    prefix = _prefix(shared_tmp)
    pool = _pool(comm, 1 << 16, f"{prefix}-c{comm.rank}")
    registry = PoolRegistry.exchange(comm, [pool], timeout=120)
    ref = pool.put(torch.ones(3, device=_device(comm)))
    assert ref is not None
    everyone = comm.allgather_object(ref.pack(), timeout=120)
    registry.close()
    peer = FeatureRef.unpack(everyone[(comm.rank + 1) % comm.size])
    with pytest.raises(IpcError, match="closed"):
        registry.resolve(peer)
    with pytest.raises(IpcError, match="closed"):
        registry.ack(peer)
    comm.barrier(timeout=120)
    pool.close()


def test_restarted_producer_is_followed_through_its_descriptor(
    comm: Communicator, shared_tmp: Path
) -> None:
    prefix = _prefix(shared_tmp)
    name = f"{prefix}-restart"
    device = _device(comm)
    first = _pool(comm, 1 << 16, name) if comm.rank == 0 else None
    registry = PoolRegistry.exchange(comm, [first] if first else [], timeout=120)
    old = first.put(torch.zeros(4, device=device)) if first else None
    old_packed = comm.allgather_object(old.pack() if old else None, timeout=120)[0]
    comm.barrier(timeout=120)
    second = None
    if comm.rank == 0:
        # The producer restarts outside any collective: same pool id, new epoch.
        assert first is not None
        first.close()
        second = _pool(comm, 1 << 16, name)
        second.bind(owner=0, consumers=list(range(1, comm.size)), node_id=comm.node_id)
        ref = second.put(torch.full((4,), 5.0, device=device), with_descriptor=True)
        assert ref is not None
        packed = ref.pack()
    new_packed = comm.broadcast_bytes(packed if comm.rank == 0 else None, 0, timeout=120)
    if comm.rank != 0:
        with registry.view(FeatureRef.unpack(new_packed)) as t:
            assert t.cpu().tolist() == [5.0] * 4
        assert registry.opens == {name: 2}
        with pytest.raises(StaleHandleError):
            registry.resolve(FeatureRef.unpack(old_packed))
    comm.barrier(timeout=120)
    registry.close()
    if second is not None:
        assert second.reclaim() == 1
        second.close()
    comm.barrier(timeout=120)
    assert _leftovers(prefix) == []
