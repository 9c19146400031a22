"""Best-fit ranges and generation-tagged slots, over host memory."""

from __future__ import annotations

import pytest

from distcache.errors import IpcError
from distcache.ipc._allocator import Lease, SlotAllocator
from distcache.ipc._layout import ALIGNMENT, Layout, WordArray, header_bytes


class Pool:
    """An allocator over a bytearray, with helpers to play the consumers."""

    def __init__(self, capacity: int, *, slots: int = 8, consumers: int = 2) -> None:
        self.gone = set()
        self.layout = Layout(slots, consumers)
        self.consumers = consumers
        self.stride = self.layout.stride
        self.start = header_bytes(slots, consumers)
        self.memory = bytearray(self.start)
        self.words = WordArray(memoryview(self.memory), self.stride)
        self.alloc = SlotAllocator(
            capacity,
            data_start=self.start,
            slots=slots,
            ack_words=consumers,
            words=self.words,
            consumers=consumers,
            gone=self.gone.__contains__,
        )

    #: Consumer indices that left or died.
    gone: set[int]

    def put(self, nbytes: int, audience: tuple[int, ...] | None = None) -> Lease:
        lease = self.alloc.allocate(nbytes, audience)
        assert lease is not None
        self.alloc.publish(lease)
        return lease

    def ack(self, lease: Lease, consumer: int, generation: int | None = None) -> None:
        gen = lease.generation if generation is None else generation
        self.words.set(self.layout.ack(lease.slot, consumer), gen)

    def ack_all(self, lease: Lease) -> None:
        for consumer in range(self.consumers):
            self.ack(lease, consumer)


def test_ranges_are_aligned_and_rounded_up() -> None:
    pool = Pool(4096)
    a, b = pool.put(1), pool.put(300)
    assert a.offset % ALIGNMENT == 0 and b.offset % ALIGNMENT == 0
    assert (a.size, b.size) == (256, 512)
    assert b.offset == a.offset + 256
    assert a.offset >= pool.start


def test_best_fit_picks_the_smallest_hole_that_fits() -> None:
    pool = Pool(8 * 256, slots=16)
    leases = [pool.put(256), pool.put(3 * 256), pool.put(256), pool.put(256 * 2), pool.put(256)]
    # Free a 3-range hole and a 2-range hole; a 2-range request must take the 2-hole.
    for lease in (leases[1], leases[3]):
        pool.alloc.cancel(lease.slot, lease.generation)
    assert pool.put(2 * 256).offset == leases[3].offset
    assert pool.put(256).offset == leases[1].offset


def test_adjacent_free_ranges_coalesce() -> None:
    pool = Pool(4 * 256)
    leases = [pool.put(256) for _ in range(4)]
    for lease in (leases[0], leases[2], leases[1], leases[3]):
        pool.alloc.cancel(lease.slot, lease.generation)
    assert pool.alloc.free_ranges() == [(pool.start, pool.start + 4 * 256)]
    assert pool.put(4 * 256).offset == pool.start


def test_fragmented_pool_answers_no_lease_despite_enough_total_space() -> None:
    pool = Pool(4 * 256)
    leases = [pool.put(256) for _ in range(4)]
    for lease in (leases[0], leases[2]):
        pool.alloc.cancel(lease.slot, lease.generation)
    assert pool.alloc.free_bytes == 512
    assert pool.alloc.allocate(512) is None


def test_full_pool_answers_no_lease() -> None:
    pool = Pool(2 * 256)
    pool.put(512)
    assert pool.alloc.allocate(1) is None


def test_no_free_slot_answers_no_lease() -> None:
    pool = Pool(64 * 256, slots=2)
    pool.put(1), pool.put(1)
    assert pool.alloc.allocate(1) is None


def test_range_is_reused_only_after_every_consumer_acked() -> None:
    pool = Pool(256)
    lease = pool.put(100)
    assert pool.alloc.allocate(1) is None
    pool.ack(lease, 0)
    assert pool.alloc.allocate(1) is None  # consumer 1 has not acked yet
    pool.ack(lease, 1)
    again = pool.alloc.allocate(1)
    assert again is not None and again.offset == lease.offset


def test_stale_ack_of_an_earlier_generation_does_not_free_the_slot() -> None:
    pool = Pool(256, slots=1)
    first = pool.put(1)
    pool.ack_all(first)
    second = pool.put(1)
    assert second.slot == first.slot and second.generation == first.generation + 1
    # The ack words still hold the first generation: not an ack of the second.
    assert pool.alloc.reclaim() == 0
    assert pool.alloc.allocate(1) is None


def test_unpublished_lease_is_not_reclaimed_even_if_acked() -> None:
    pool = Pool(256)
    lease = pool.alloc.allocate(1)
    assert lease is not None
    pool.ack_all(lease)
    assert pool.alloc.reclaim() == 0


def test_release_clears_the_ready_lease_and_audience_words() -> None:
    pool = Pool(1024, consumers=40)  # two audience words
    lease = pool.put(1)
    layout = pool.layout
    assert pool.words.get(layout.ready(lease.slot)) == lease.generation
    assert pool.words.get(layout.lease(lease.slot)) == lease.generation
    assert [pool.words.get(layout.mask(lease.slot) + w) for w in (0, 1)] == [0xFFFFFFFF, 0xFF]
    pool.ack_all(lease)
    assert pool.alloc.reclaim() == 1
    words = [pool.words.get(i) for i in range(lease.slot * layout.stride, layout.ack(lease.slot, 0))]
    assert words == [0, 0, 0, 0]


def test_a_declared_reader_alone_frees_its_lease() -> None:
    pool = Pool(256, slots=4, consumers=3)
    lease = pool.put(256, audience=(1,))
    mask = pool.words.get(pool.layout.mask(lease.slot))
    assert mask == 0b010
    assert pool.alloc.allocate(1) is None  # the one range is held
    pool.ack(lease, 0)
    pool.ack(lease, 2)
    assert pool.alloc.reclaim() == 0  # the others' acks mean nothing for it
    pool.ack(lease, 1)
    assert pool.alloc.reclaim() == 1


def test_audience_outside_the_consumers_is_refused() -> None:
    pool = Pool(1024, consumers=2)
    with pytest.raises(IpcError, match="outside"):
        pool.alloc.allocate(1, (2,))
    assert pool.alloc.in_flight == 0


def test_a_gone_consumer_releases_its_part_of_every_lease() -> None:
    pool = Pool(1024, slots=8, consumers=2)
    both = pool.put(256)
    pool.put(256, audience=(1,))
    pool.ack(both, 0)
    assert pool.alloc.reclaim() == 0
    pool.gone.add(1)  # consumer 1 left or died with both leases unacknowledged
    assert pool.alloc.reclaim() == 2
    assert pool.alloc.free_bytes == pool.alloc.capacity


def test_gone_is_asked_once_per_consumer_per_reclaim() -> None:
    pool = Pool(4096, slots=16, consumers=2)
    asked: list[int] = []
    pool.alloc._gone = lambda i: asked.append(i) or False  # type: ignore[assignment]
    for _ in range(10):
        pool.put(256)
    assert pool.alloc.reclaim() == 0
    assert asked == [0]  # consumer 0 blocks every lease; asked once, not ten times


def test_cancel_frees_a_lease_that_was_never_sent() -> None:
    pool = Pool(256)
    lease = pool.put(1)
    pool.alloc.cancel(lease.slot, lease.generation)
    assert pool.alloc.in_flight == 0
    assert pool.put(256).offset == lease.offset


def test_cancel_of_an_unknown_or_released_lease_raises() -> None:
    pool = Pool(1024)
    lease = pool.put(1)
    with pytest.raises(IpcError):
        pool.alloc.cancel(lease.slot, lease.generation + 1)
    pool.alloc.cancel(lease.slot, lease.generation)
    with pytest.raises(IpcError):
        pool.alloc.cancel(lease.slot, lease.generation)


def test_allocation_before_consumers_are_known_raises() -> None:
    memory = bytearray(header_bytes(4, 2))
    alloc = SlotAllocator(
        1024, data_start=len(memory), slots=4, ack_words=2, words=WordArray(memoryview(memory), 3)
    )
    with pytest.raises(IpcError, match="consumers"):
        alloc.allocate(1)
    with pytest.raises(IpcError):
        alloc.bind(3)  # more consumers than ack words
    alloc.bind(2)
    assert alloc.allocate(1) is not None


def test_many_cycles_keep_the_free_list_whole() -> None:
    pool = Pool(16 * 256, slots=8)
    live: list[Lease] = []
    for i in range(500):
        lease = pool.alloc.allocate(1 + (i * 97) % 1000)
        if lease is None:
            for old in live:
                pool.ack_all(old)
            live.clear()
            lease = pool.alloc.allocate(1 + (i * 97) % 1000)
            assert lease is not None
        pool.alloc.publish(lease)
        live.append(lease)
    for old in live:
        pool.ack_all(old)
    pool.alloc.reclaim()
    assert pool.alloc.free_ranges() == [(pool.start, pool.start + 16 * 256)]
