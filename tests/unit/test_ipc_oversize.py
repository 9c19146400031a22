"""A feature larger than a pool can ever lease is refused with an error, not None.

``put`` answers None only while the pool is full for now (the caller retries until a
deadline); a feature that no lease can ever hold raises at once, so the caller does
not spin until its deadline for nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from distcache.errors import IpcError
from distcache.ipc import ShmPool
from distcache.ipc._allocator import SlotAllocator
from distcache.ipc._layout import ALIGNMENT, Layout, WordArray


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    with ShmPool(1024, consumers=[1], slots=4) as made:
        made.bind(0, [1])
        yield made


def _bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_a_feature_of_exactly_the_capacity_fits_an_empty_pool(pool: ShmPool) -> None:
    ref = pool.put(_bytes(pool.capacity))
    assert ref is not None and ref.nbytes == pool.capacity
    assert pool.free_bytes == 0


def test_one_byte_more_than_the_capacity_raises_naming_both_sizes(pool: ShmPool) -> None:
    with pytest.raises(IpcError) as caught:
        pool.put(_bytes(pool.capacity + 1))
    message = str(caught.value)
    assert f"{pool.capacity + 1} bytes" in message
    assert f"{pool.capacity} bytes" in message
    assert pool.pool_id in message
    assert pool.full_count == 0 and pool.in_flight == 0
    assert pool.free_bytes == pool.capacity


def test_an_oversized_feature_raises_even_while_the_pool_is_full(pool: ShmPool) -> None:
    assert pool.put(_bytes(pool.capacity)) is not None
    with pytest.raises(IpcError, match="never fit"):
        pool.put(_bytes(pool.capacity + 1))
    assert pool.full_count == 0


def test_the_limit_counts_bytes_not_elements(pool: ShmPool) -> None:
    per = pool.capacity // 4
    assert pool.put(torch.zeros(per, dtype=torch.float32)) is not None
    pool.reclaim()
    with pytest.raises(IpcError, match=f"{4 * (per + 1)} bytes"):
        pool.put(torch.zeros(per + 1, dtype=torch.float32))


def test_a_feature_that_fits_but_not_now_still_answers_none(pool: ShmPool) -> None:
    held = pool.put(_bytes(ALIGNMENT))
    assert held is not None
    assert pool.put(_bytes(pool.capacity)) is None
    assert pool.full_count == 1
    pool.cancel(held)
    assert pool.put(_bytes(pool.capacity)) is not None


def test_an_unaligned_capacity_is_rounded_up_and_its_whole_size_fits() -> None:
    with ShmPool(ALIGNMENT + 1, consumers=[1], slots=2) as pool:
        pool.bind(0, [1])
        assert pool.capacity == 2 * ALIGNMENT
        assert pool.put(_bytes(2 * ALIGNMENT)) is not None
        pool.reclaim()
        with pytest.raises(IpcError, match=f"{2 * ALIGNMENT} bytes"):
            pool.put(_bytes(2 * ALIGNMENT + 1))


def _allocator(capacity: int) -> SlotAllocator:
    layout = Layout(4, 1)
    start = layout.header_bytes
    words = WordArray(memoryview(bytearray(start)), layout.stride)
    return SlotAllocator(capacity, data_start=start, slots=4, ack_words=1, words=words, consumers=1)


@pytest.mark.parametrize("capacity", [ALIGNMENT, 3 * ALIGNMENT, 3 * ALIGNMENT + 100])
def test_the_allocator_leases_its_largest_size_and_refuses_one_byte_more(capacity: int) -> None:
    alloc = _allocator(capacity)
    largest = capacity - capacity % ALIGNMENT
    assert alloc.largest == largest
    with pytest.raises(IpcError, match=f"{largest + 1} bytes"):
        alloc.allocate(largest + 1)
    lease = alloc.allocate(largest)
    assert lease is not None and lease.size == largest
    assert alloc.allocate(1) is None  # full for now, not too large
