"""``put`` must not leak a lease on a tensor whose ref it cannot describe, and takes
only ranks as readers.

A contiguous tensor of more than 16 dimensions (or with a dimension past 2**48, which
an empty tensor can have) was leased, written and published before its
``FeatureRef`` refused it: the ``IpcError`` came back but the lease stayed in flight,
declared for readers that never got a ref, so it was never acknowledged or
reclaimed. Four such calls filled a 4-slot pool for good. The readers of ``put``
were taken through ``int()``: ``[1.7]``, ``[True]`` and ``["2"]`` declared ranks 1, 1
and 2, and ``consumers=1`` raised a ``TypeError``, where the pool's own consumers are
held to :func:`~distcache.ipc._wire.consumer_ranks`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from distcache.errors import IpcError
from distcache.ipc import PoolRegistry, ShmPool


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    with ShmPool(4096, slots=4) as made:
        made.bind(owner=0, consumers=[1, 2])
        yield made


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros([1] * 17),
        torch.zeros([2] * 8 + [1] * 9, dtype=torch.uint8),
        torch.empty(0, 1 << 49, dtype=torch.uint8),
    ],
    ids=["17-dims", "17-dims-bytes", "empty-huge-dim"],
)
def test_a_tensor_its_ref_cannot_describe_leaks_no_lease(pool: ShmPool, tensor: Any) -> None:
    for _ in range(pool.slots + 1):
        with pytest.raises(IpcError, match="invalid feature reference"):
            pool.put(tensor)
        assert pool.in_flight == 0
        assert pool.free_bytes == pool.capacity
    ref = pool.put(torch.arange(4.0))
    assert ref is not None


def test_a_refused_tensor_leaves_the_slot_for_the_next_feature(pool: ShmPool) -> None:
    reader = PoolRegistry(1)
    reader.add(pool.descriptor())
    with pytest.raises(IpcError):
        pool.put(torch.zeros([1] * 17), consumers=[1])
    ref = pool.put(torch.arange(8.0), consumers=[1])
    assert ref is not None
    assert torch.equal(reader.fetch(ref), torch.arange(8.0))
    assert pool.reclaim() == 1 and pool.in_flight == 0
    reader.close()


@pytest.mark.parametrize("readers", [[1.7], [True], ["2"], [2.0], 1, "1", b"\x01"])
def test_readers_that_are_not_ranks_are_refused(pool: ShmPool, readers: Any) -> None:
    with pytest.raises(IpcError, match="readers"):
        pool.put(torch.ones(2), consumers=readers)
    assert pool.in_flight == 0


def test_integer_readers_of_any_integer_type_are_taken(pool: ShmPool) -> None:
    import numpy as np

    readers: list[Any] = [np.int64(2), 1]
    ref = pool.put(torch.ones(2), consumers=readers)
    assert ref is not None
    assert pool.in_flight == 1
