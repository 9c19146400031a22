"""A producer outside the consumers' group (``owner=None``) unlinks its pool's name in
/dev/shm once every consumer has mapped it, wherever it next looks at its consumers
(``put``, ``reclaim``, ``holders``), not only in ``put``: a burst put before the
consumers map the pool, followed by reclaims only, must not leave the name behind
(docs/ipc.md: "so a crash leaks nothing")."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator

import pytest
import torch

from distcache.ipc import PoolRegistry, ShmPool
from distcache.store._fs import unlink_quietly
from tests.support.ipc_exchange import shm_names


@pytest.fixture
def outside() -> Iterator[ShmPool]:
    """A pool bound to consumers 0 and 1 by a producer that is no rank of theirs,
    with one feature put before either consumer mapped it; /dev/shm is left clean."""
    prefix = f"unlinkmapped-{os.getpid()}-{secrets.token_hex(3)}"
    pool = ShmPool(1 << 16, slots=8, name=prefix)
    try:
        pool.bind(owner=None, consumers=[0, 1])
        yield pool
    finally:
        pool.close()
        unlink_quietly(pool.path)
        assert not shm_names(prefix)


def _burst_then_map(pool: ShmPool, registries: list[PoolRegistry]) -> None:
    ref = pool.put(torch.arange(6, dtype=torch.float32))
    assert ref is not None
    assert os.path.exists(pool.path)  # put saw no consumer mapped: the name stays
    for registry in registries:
        registry.add(pool.descriptor().pack())
        assert registry.opens == {pool.pool_id: 1}
    assert os.path.exists(pool.path) and pool.linked  # nothing looked yet
    for registry in registries:
        assert registry.fetch(ref).tolist() == list(range(6))


@pytest.mark.parametrize(
    ("look", "answer", "left"),
    [(ShmPool.reclaim, 1, 1), (ShmPool.holders, [0, 1], 2)],
    ids=["reclaim", "holders"],
)
def test_the_name_goes_when_the_producer_next_looks_at_its_consumers(
    outside: ShmPool, look: Callable[[ShmPool], object], answer: object, left: int
) -> None:
    registries = [PoolRegistry(rank) for rank in (0, 1)]
    try:
        _burst_then_map(outside, registries)
        assert look(outside) == answer
        assert not outside.linked
        assert not os.path.exists(outside.path)  # a producer killed now leaks nothing
        # The mappings outlive the name: the pool keeps serving.
        again = outside.put(torch.full((3,), 7.0))
        assert again is not None
        assert [registry.fetch(again).tolist() for registry in registries] == [[7.0] * 3] * 2
        assert outside.reclaim() == left  # holders() frees nothing: both leases then
        assert outside.holders() == [0, 1]
    finally:
        for registry in registries:
            registry.close()


def test_the_name_stays_until_every_consumer_mapped(outside: ShmPool) -> None:
    first = PoolRegistry(0)
    second = PoolRegistry(1)
    try:
        ref = outside.put(torch.arange(4))
        assert ref is not None
        first.add(outside.descriptor().pack())
        assert first.fetch(ref).tolist() == list(range(4))
        assert outside.reclaim() == 0  # consumer 1 has not acked
        assert outside.holders() == [0]
        assert outside.linked and os.path.exists(outside.path)  # consumer 1 still maps by name
        second.add(outside.descriptor().pack())
        assert second.fetch(ref).tolist() == list(range(4))
        assert outside.reclaim() == 1
        assert not outside.linked and not os.path.exists(outside.path)
    finally:
        first.close()
        second.close()


def test_an_owner_rank_keeps_its_name_for_the_exchange_barrier() -> None:
    prefix = f"unlinkowner-{os.getpid()}-{secrets.token_hex(3)}"
    with ShmPool(1 << 16, slots=8, name=prefix) as pool:
        pool.bind(owner=0, consumers=[1])
        registry = PoolRegistry(1)
        try:
            ref = pool.put(torch.arange(3))
            assert ref is not None
            registry.add(pool.descriptor())
            assert registry.fetch(ref).tolist() == [0, 1, 2]
            assert pool.reclaim() == 1
            assert pool.holders() == [1]
            assert pool.linked and os.path.exists(pool.path)  # the registry unlinks it
        finally:
            registry.close()
    assert not shm_names(prefix)
