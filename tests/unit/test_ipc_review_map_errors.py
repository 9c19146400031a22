"""A pool that a consumer cannot map is named, with its owner and the consumer.

When a consumer failed to map a peer's pool at :meth:`PoolRegistry.exchange` (its
segment of another size, another user's, gone), every rank raised the mapping's own
message, ``segment /dev/shm/distcache.<id>.<epoch> is 100 bytes, descriptor says
6144``: the owner learned that some rank could not map its pool, but neither which
rank failed nor (beyond a path) whose pool it was. Other ranks rebuild the lowest
failing rank's error from its text, so the text must carry both.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import pytest

from distcache.comm import ThreadGroup
from distcache.errors import IpcError
from distcache.ipc import PoolRegistry, ShmPool
from tests.support.helpers import on_threads

pytest.importorskip("torch")


def _exchange_with_a_broken_segment(tag: str) -> list[Any]:
    """Rank 0's pool, whose segment no longer has its size, exchanged among 3 ranks."""
    group = ThreadGroup(3, timeout=60)

    def main(rank: int) -> Any:
        comm = group.comm(rank)
        pool = ShmPool(4096, slots=4, name=f"{tag}{rank}") if rank == 0 else None
        if pool is not None:
            os.truncate(pool.path, 100)
        try:
            registry = PoolRegistry.exchange(comm, [pool] if pool is not None else [])
            registry.close()
            return "mapped"
        finally:
            if pool is not None:
                pool.close()

    return on_threads(3, main)  # each rank's answer, or the IpcError it raised


def test_every_rank_learns_which_rank_could_not_map_whose_pool() -> None:
    tag = f"brk{os.getpid()}r"
    results = _exchange_with_a_broken_segment(tag)
    assert all(isinstance(r, IpcError) for r in results), results
    for rank, exc in enumerate(results):
        text = str(exc)
        assert "100 bytes" in text, text  # the cause is kept
        assert f"pool {tag}0 of rank 0" in text, text
        # The owner and rank 2 hear of rank 1 (the lowest that failed), rank 1 and
        # rank 2 of themselves.
        failed = 2 if rank == 2 else 1
        assert re.search(rf"\brank {failed} could not map pool", text), text
        assert exc.pool_id == f"{tag}0"


def test_an_outside_producers_pool_that_cannot_be_mapped_is_named() -> None:
    with ShmPool(4096, slots=4, name=f"brk{os.getpid()}out") as pool:
        pool.bind(owner=None, consumers=[3])
        os.truncate(pool.path, 100)
        registry = PoolRegistry(3)
        with pytest.raises(IpcError) as caught:
            registry.add(pool.descriptor().pack())
        text = str(caught.value)
        assert f"rank 3 could not map pool {pool.pool_id} of a producer outside the group" in text
        assert "100 bytes" in text
        assert registry.opens == {}
        registry.close()


def test_a_descriptor_naming_another_segment_is_still_refused_by_name() -> None:
    with ShmPool(4096, slots=4, name=f"brk{os.getpid()}name") as pool:
        pool.bind(owner=0, consumers=[1])
        forged = dataclasses.replace(pool.descriptor(), handle=b"distcache.other.1")
        registry = PoolRegistry(1)
        with pytest.raises(IpcError, match=r"rank 1 could not map pool .* not its own"):
            registry.add(forged)
        registry.close()
