"""What the serving path checks of a ref against the pool it names: a close racing a
serving call, the consumer ranks a pool is given, and a ref's offset and bytes against
the lease of its slot. Host shared memory, within one process."""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

import pytest
import torch

from distcache.errors import IpcError
from distcache.ipc import CudaPool, FeatureRef, PoolRegistry, ShmPool
from distcache.ipc._allocator import SlotAllocator
from distcache.ipc._layout import Layout, WordArray
from tests.support.ipc_pools import pool_fixtures

pool, readers = pool_fixtures()


def _segment_mapped(pool: ShmPool) -> bool:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return any(pool.segment in line for line in maps)


@pytest.mark.parametrize("call", ["fetch", "resolve", "ack"])
def test_close_inside_a_serving_call_raises_the_closed_error_and_releases(
    pool: ShmPool, readers: dict[int, PoolRegistry], call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = readers[1]
    ref = pool.put(torch.full((4,), 5.0), consumers=[1])
    later = pool.put(torch.full((4,), 6.0), consumers=[1])
    assert ref is not None and later is not None
    checked = PoolRegistry._checked

    def close_after_checks(self: PoolRegistry, ref: FeatureRef) -> Any:
        # The close lands between the checks and the reads and writes that follow them.
        found = checked(self, ref)
        self.close()
        return found

    monkeypatch.setattr(PoolRegistry, "_checked", close_after_checks)
    try:
        result = getattr(registry, call)(ref)
    except IpcError as exc:  # the words it was to read or write are gone
        assert "closed" in str(exc)
        result = None
    monkeypatch.undo()
    if result is not None and call in ("fetch", "resolve"):
        assert torch.equal(result, torch.full((4,), 5.0))  # a live view still reads
    assert pool.holders() == [2]
    with pytest.raises(IpcError, match="closed"):
        registry.fetch(later)
    del result


def test_close_racing_fetches_on_another_thread_raises_ipc_error_only() -> None:
    unexpected: list[BaseException] = []
    for _ in range(60):
        pool = ShmPool(1 << 16, slots=64)
        pool.bind(owner=None, consumers=[0])
        registry = PoolRegistry(0)
        registry.add(pool.descriptor())
        refs = [pool.put(torch.full((16,), float(i))) for i in range(64)]
        start = threading.Event()

        def serve(registry: PoolRegistry = registry, refs: list[Any] = refs,
                  start: threading.Event = start) -> None:
            start.wait()
            try:
                for ref in refs:
                    registry.fetch(ref)
            except IpcError:
                pass
            except BaseException as exc:
                unexpected.append(exc)

        thread = threading.Thread(target=serve)
        thread.start()
        start.set()
        registry.close()
        thread.join()
        assert pool.holders() == []
        pool.close()
        assert not _segment_mapped(pool)
    assert unexpected == []


# -- the consumer ranks a pool is given ---------------------------------------------
BAD_RANKS = [["x"], [None], [-1], [2**40], [0.7, 1.2], [True], [1, 2.0]]


def _named(value: list[Any]) -> str:
    bad = next(r for r in value if type(r) is not int or not 0 <= r < 2**32)
    return re.escape(repr(bad))


@pytest.mark.parametrize("ranks", BAD_RANKS)
def test_shm_pool_refuses_consumers_that_are_not_ranks(ranks: list[Any]) -> None:
    with pytest.raises(IpcError, match=_named(ranks)):
        ShmPool(1 << 12, slots=4, consumers=ranks)


@pytest.mark.parametrize("ranks", BAD_RANKS)
def test_cuda_pool_refuses_consumers_that_are_not_ranks(ranks: list[Any]) -> None:
    # Refused before any device is touched.
    with pytest.raises(IpcError, match=_named(ranks)):
        CudaPool(1 << 12, 0, slots=4, consumers=ranks)


@pytest.mark.parametrize("ranks", BAD_RANKS)
def test_bind_refuses_consumers_that_are_not_ranks(ranks: list[Any]) -> None:
    with ShmPool(1 << 12, slots=4) as pool:
        with pytest.raises(IpcError, match=_named(ranks)):
            pool.bind(None, ranks)
        pool.bind(None, [0, 1])  # a refused bind left nothing behind
        assert pool.descriptor().consumers == (0, 1)


def test_consumers_that_are_not_a_sequence_are_refused() -> None:
    with pytest.raises(IpcError, match="3"):
        ShmPool(1 << 12, slots=4, consumers=3)  # type: ignore[arg-type]


def test_integer_ranks_of_any_integer_type_are_taken() -> None:
    with ShmPool(1 << 12, slots=4, consumers=[torch.tensor(3), 2**32 - 1]) as pool:
        pool.bind(None, [])
        assert pool.descriptor().consumers == (3, 2**32 - 1)


# -- a ref's offset and bytes against its slot's lease --------------------------------
def test_a_ref_moved_onto_another_lease_is_refused(
    pool: ShmPool, readers: dict[int, PoolRegistry]
) -> None:
    secret = pool.put(torch.full((4,), 111.0), consumers=[1])
    mine = pool.put(torch.full((4,), 222.0), consumers=[2])
    assert secret is not None and mine is not None
    forged = FeatureRef.unpack(dataclasses.replace(mine, offset=secret.offset).pack())
    for call in ("fetch", "resolve", "ack"):
        with pytest.raises(IpcError, match="lease"):
            getattr(readers[2], call)(forged)
    # The refusals wrote nothing: the true ref still serves, and the reader still can.
    assert torch.equal(readers[2].fetch(mine), torch.full((4,), 222.0))
    assert torch.equal(readers[1].fetch(secret), torch.full((4,), 111.0))


@pytest.mark.parametrize(("count", "shift"), [(192, 0), (2, 0), (4, 256), (64, -256)])
def test_a_ref_whose_bytes_are_not_its_lease_is_refused(
    pool: ShmPool, readers: dict[int, PoolRegistry], count: int, shift: int
) -> None:
    before = pool.put(torch.full((64,), 1.0), consumers=[1])
    mine = pool.put(torch.full((4,), 7.0), consumers=[2])
    after = pool.put(torch.full((64,), 3.0), consumers=[1])
    assert before is not None and mine is not None and after is not None
    forged = dataclasses.replace(
        mine, offset=mine.offset + shift, nbytes=4 * count, shape=(count,)
    )
    with pytest.raises(IpcError, match="lease"):
        readers[2].fetch(forged)
    assert torch.equal(readers[2].fetch(mine), torch.full((4,), 7.0))


def test_lease_extents_are_recorded_past_four_gib() -> None:
    layout = Layout(4, 2)
    words = WordArray(memoryview(bytearray(layout.header_bytes)), layout.stride)
    alloc = SlotAllocator(
        1 << 36, data_start=layout.header_bytes, slots=4, ack_words=2, words=words, consumers=2
    )
    leases = [alloc.allocate(n) for n in (5 << 30, 7 << 30 | 3)]
    w = words.array
    for lease in leases:
        assert lease is not None
        at = layout.extent(lease.slot)
        assert (w[at] | w[at + 1] << 32, w[at + 2] | w[at + 3] << 32) == (
            lease.offset,
            lease.nbytes,
        )
    assert leases[1] is not None and leases[1].offset > 1 << 32
