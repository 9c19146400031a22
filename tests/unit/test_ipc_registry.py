"""PoolRegistry: map each peer pool once, resolve checked views, stale handles."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distcache.comm import ThreadGroup
from distcache.comm._base import Communicator
from distcache.errors import IpcError, StaleHandleError
from distcache.ipc import FeatureRef, PoolRegistry, ShmPool
from distcache.ipc._ref import DTYPES

RANKS = 4


def run_ranks(size: int, body: Callable[[Communicator], Any]) -> list[Any]:
    """Run ``body`` on ``size`` thread-ranks; re-raise the first failure."""
    group = ThreadGroup(size, timeout=60)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            results[rank] = body(group.comm(rank))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread-rank hung"
    if errors:
        raise errors[0]
    return results


def feature(rank: int, i: int) -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32).reshape(8, 8) + rank * 10_000 + i


def test_thousand_features_map_each_peer_pool_once() -> None:
    rounds, per_round = 10, 100

    def body(comm: Communicator) -> dict[str, Any]:
        # Room for one round only: later rounds reuse ranges freed by acks.
        pool = ShmPool(per_round * 256, name=f"rank{comm.rank}", slots=per_round)
        registry = PoolRegistry.exchange(comm, [pool])
        path_gone = not os.path.exists(pool.path)
        resolved = 0
        for r in range(rounds):
            refs = []
            for i in range(per_round):
                ref = pool.put(feature(comm.rank, r * per_round + i))
                assert ref is not None, f"pool full in round {r}: acks did not free slots"
                refs.append(ref.pack())
            everyone = comm.allgather_object(refs)
            for src, packed in enumerate(everyone):
                if src == comm.rank:
                    continue
                for i, data in enumerate(packed):
                    with registry.view(FeatureRef.unpack(data)) as t:
                        assert torch.equal(t, feature(src, r * per_round + i))
                    resolved += 1
            comm.barrier()
        opens = dict(registry.opens)
        registry.close()
        registry.close()
        with pytest.raises(IpcError, match="closed"):
            registry.resolve(FeatureRef.unpack(everyone[(comm.rank + 1) % RANKS][0]))
        comm.barrier()
        pool.close()
        return {"opens": opens, "resolved": resolved, "path_gone": path_gone}

    results = run_ranks(RANKS, body)
    for rank, res in enumerate(results):
        assert res["opens"] == {f"rank{p}": 1 for p in range(RANKS) if p != rank}
        assert f"rank{rank}" not in res["opens"]
        assert res["resolved"] == 1000 * (RANKS - 1)
        assert res["path_gone"], "owner did not unlink its segment after the exchange"


def test_exchange_with_pools_on_some_ranks_only() -> None:
    def body(comm: Communicator) -> dict[str, int]:
        pools = [ShmPool(4096, name="only")] if comm.rank == 0 else []
        registry = PoolRegistry.exchange(comm, pools)
        opens = dict(registry.opens)
        registry.close()
        comm.barrier()
        for pool in pools:
            pool.close()
        return opens

    results = run_ranks(3, body)
    assert results == [{}, {"only": 1}, {"only": 1}]


def test_duplicate_pool_ids_fail_on_every_rank() -> None:
    def body(comm: Communicator) -> str:
        pool = ShmPool(4096, name="same")
        try:
            PoolRegistry.exchange(comm, [pool])
        except IpcError as exc:
            return str(exc)
        finally:
            pool.close()
        return "no error"

    for message in run_ranks(2, body):
        assert "claimed by ranks" in message


def test_nodes_only_map_pools_of_their_own_node() -> None:
    group = ThreadGroup(4, node_ids=["a", "a", "b", "b"], timeout=60)
    results: list[Any] = [None] * 4

    def main(rank: int) -> None:
        comm = group.comm(rank)
        pool = ShmPool(4096, name=f"n{rank}")
        registry = PoolRegistry.exchange(comm, [pool])
        results[rank] = (dict(registry.opens), pool.consumers)
        registry.close()
        comm.barrier()
        pool.close()

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0] == ({"n1": 1}, (1,))
    assert results[3] == ({"n2": 1}, (2,))


# -- resolve against forged and stale refs (one consumer, no collective) -------------


@pytest.fixture
def served() -> Any:
    pool = ShmPool(4096, consumers=[1], name="served", slots=4)
    pool.bind(owner=0, consumers=[1])
    registry = PoolRegistry(rank=1)
    registry.add(pool.descriptor())
    yield pool, registry
    registry.close()
    pool.close()


def _forge(ref: FeatureRef, **changes: Any) -> FeatureRef:
    fields = {f: getattr(ref, f) for f in ref.__dataclass_fields__}
    fields.update(changes)
    return FeatureRef(**fields)


def test_resolve_returns_a_zero_copy_view(served: Any) -> None:
    pool, registry = served
    ref = pool.put(torch.arange(6, dtype=torch.int64).reshape(2, 3))
    a, b = registry.resolve(ref), registry.resolve(ref)
    assert a.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert a.data_ptr() == b.data_ptr()
    a[0, 0] = 42
    assert b[0, 0].item() == 42


@pytest.mark.parametrize(
    "changes",
    [
        {"offset": 4096 * 4},  # past the end
        {"offset": 0},  # into the control words
        {"offset": 1},  # unaligned (and into the header)
        {"slot": 4},  # past the slot table
        {"generation": 2},  # not the published generation
        {"nbytes": 8 * 600, "shape": (600,), "strides": (1,)},  # runs past the end
    ],
)
def test_forged_refs_are_rejected_by_resolve_and_ack(served: Any, changes: dict[str, Any]) -> None:
    pool, registry = served
    ref = pool.put(torch.arange(6, dtype=torch.int64))
    forged = _forge(ref, **changes)
    with pytest.raises(IpcError):
        registry.resolve(forged)
    with pytest.raises(IpcError):
        registry.ack(forged)


def test_unknown_pool_raises_ipc_error(served: Any) -> None:
    pool, registry = served
    ref = pool.put(torch.zeros(2))
    with pytest.raises(IpcError, match="not mapped"):
        registry.resolve(_forge(ref, pool_id="elsewhere"))


def test_released_feature_can_no_longer_be_resolved(served: Any) -> None:
    pool, registry = served
    ref = pool.put(torch.zeros(2))
    registry.ack(ref)
    assert pool.reclaim() == 1
    with pytest.raises(IpcError, match="released"):
        registry.resolve(ref)


def test_cancelled_feature_can_no_longer_be_resolved(served: Any) -> None:
    pool, registry = served
    ref = pool.put(torch.zeros(2))
    pool.cancel(ref)
    with pytest.raises(IpcError):
        registry.resolve(ref)


@settings(max_examples=150, deadline=None)
@given(
    offset=st.integers(0, 1 << 20),
    slot=st.integers(0, 8),
    generation=st.integers(1, 3),
    dtype=st.sampled_from(sorted(name for name, _ in DTYPES.values())),
    count=st.integers(0, 2000),
)
def test_fuzzed_refs_never_read_outside_the_segment(
    offset: int, slot: int, generation: int, dtype: str, count: int
) -> None:
    pool = ShmPool(4096, consumers=[1], name="fuzz", slots=4)
    try:
        pool.bind(owner=0, consumers=[1])
        for _ in range(4):
            pool.put(torch.zeros(16))
        registry = PoolRegistry(rank=1)
        registry.add(pool.descriptor())
        size = dict(DTYPES.values())[dtype]
        ref = FeatureRef(
            "fuzz", pool.epoch, offset, count * size, dtype, (count,), (1,), slot, generation
        )
        try:
            view = registry.resolve(ref)
        except IpcError:
            pass
        else:
            # One byte, not zero: torch may report data_ptr() == 0 for an empty view.
            mapping = registry._entries["fuzz"].mapping.view(0, 1)
            lo = mapping.data_ptr() + pool.data_start
            hi = mapping.data_ptr() + pool.data_start + pool.capacity
            if ref.nbytes:  # torch reports data_ptr() == 0 for a tensor with no elements
                assert lo <= view.data_ptr() and view.data_ptr() + ref.nbytes <= hi
            del view, mapping
        registry.close()
    finally:
        pool.close()


def test_restarted_producer_is_remapped_once_from_the_carried_descriptor(served: Any) -> None:
    pool, registry = served
    old_ref = pool.put(torch.zeros(2))
    restarted = ShmPool(4096, consumers=[1], name="served", slots=4)  # same id, new epoch
    try:
        restarted.bind(owner=0, consumers=[1])
        assert restarted.epoch > pool.epoch
        bare = restarted.put(torch.full((3,), 7.0))
        with pytest.raises(StaleHandleError):
            registry.resolve(bare)  # unknown epoch, no descriptor: never the old mapping
        ref = restarted.put(torch.full((3,), 8.0), with_descriptor=True)
        assert registry.resolve(ref).tolist() == [8.0, 8.0, 8.0]
        assert registry.opens == {"served": 2}
        assert registry.resolve(bare).tolist() == [7.0, 7.0, 7.0]  # now mapped
        with pytest.raises(StaleHandleError):
            registry.resolve(old_ref)  # the retired epoch
        assert registry.opens == {"served": 2}
    finally:
        restarted.close()


def test_ref_of_an_older_epoch_with_descriptor_is_stale(served: Any) -> None:
    pool, registry = served
    restarted = ShmPool(4096, consumers=[1], name="served", slots=4)
    try:
        restarted.bind(owner=0, consumers=[1])
        registry.add(restarted.descriptor())
        old = pool.put(torch.zeros(1), with_descriptor=True)
        with pytest.raises(StaleHandleError):
            registry.resolve(old)
        assert registry.opens == {"served": 2}
    finally:
        restarted.close()


def test_remap_failure_is_a_stale_handle_error(served: Any) -> None:
    _, registry = served
    restarted = ShmPool(4096, consumers=[1], name="served", slots=4)
    restarted.bind(owner=0, consumers=[1])
    ref = restarted.put(torch.zeros(1), with_descriptor=True)
    restarted.close()  # the name is gone: the new epoch cannot be mapped
    with pytest.raises(StaleHandleError, match="could not be mapped"):
        registry.resolve(ref)


def test_registry_never_maps_its_own_pool() -> None:
    with ShmPool(4096, consumers=[1], name="mine") as pool:
        pool.bind(owner=0, consumers=[1])
        registry = PoolRegistry(rank=0)
        with pytest.raises(IpcError, match="owned by this rank"):
            registry.add(pool.descriptor())
        assert registry.opens == {}


def test_non_consumer_cannot_map_a_pool() -> None:
    with ShmPool(4096, consumers=[1], name="theirs") as pool:
        pool.bind(owner=0, consumers=[1])
        with pytest.raises(IpcError, match="not a consumer"):
            PoolRegistry(rank=2).add(pool.descriptor())


def test_view_context_manager_acks_on_exit(served: Any) -> None:
    pool, registry = served
    ref = pool.put(torch.ones(4))
    with registry.view(ref) as t:
        assert t.sum().item() == 4
        assert pool.reclaim() == 0
    assert pool.reclaim() == 1


def test_add_is_idempotent_for_the_same_epoch(served: Any) -> None:
    pool, registry = served
    registry.add(pool.descriptor())
    assert registry.opens == {"served": 1}
