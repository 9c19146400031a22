"""Edge cases of the IPC pools: failures that must not leak a lease, rebinding,
hostile descriptors and segments, and a registry closed mid-add."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from distcache.errors import IpcError
from distcache.ipc import PoolDescriptor, PoolRegistry, ShmPool


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    with ShmPool(4096, slots=4) as made:
        made.bind(owner=0, consumers=[1, 2])
        yield made


def test_put_with_a_descriptor_it_cannot_give_leaks_no_lease() -> None:
    with ShmPool(4096, consumers=[1], slots=4) as unbound:
        with pytest.raises(IpcError, match="not bound"):
            unbound.put(torch.ones(3), with_descriptor=True)
        assert unbound.in_flight == 0
        assert unbound.free_bytes == unbound.capacity


def test_a_bound_pool_cannot_be_rebound_to_other_consumers(pool: ShmPool) -> None:
    reader = PoolRegistry(1)
    reader.add(pool.descriptor())
    with pytest.raises(IpcError, match="already bound"):
        pool.bind(owner=0, consumers=[2, 1])
    assert pool.consumers == (1, 2)
    pool.bind(owner=0, consumers=[1, 2])  # the same binding again is a no-op
    ref = pool.put(torch.arange(4.0), consumers=[1])
    assert ref is not None
    assert torch.equal(reader.fetch(ref), torch.arange(4.0))
    reader.close()


def test_a_conjugate_view_is_stored_with_its_values(pool: ShmPool) -> None:
    source = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    reader = PoolRegistry(1)
    reader.add(pool.descriptor())
    ref = pool.put(source, consumers=[1])
    assert ref is not None
    assert torch.equal(reader.fetch(ref), source.resolve_conj())
    reader.close()


@pytest.mark.parametrize("data", [1 << 64, 12, "DCP"])
def test_descriptor_unpack_of_a_non_bytes_value_is_an_ipc_error(data: Any) -> None:
    with pytest.raises(IpcError, match="expected bytes"):
        PoolDescriptor.unpack(data)


def test_a_descriptor_that_repeats_a_consumer_is_refused(pool: ShmPool) -> None:
    desc = pool.descriptor()
    with pytest.raises(IpcError, match="repeat"):
        dataclasses.replace(desc, consumers=(1, 1))


def test_a_descriptor_with_an_unaligned_data_region_is_refused(pool: ShmPool) -> None:
    desc = pool.descriptor()
    with pytest.raises(IpcError, match="aligned"):
        dataclasses.replace(desc, data_start=desc.data_start + 8, capacity=desc.capacity - 8)


def test_a_descriptor_naming_another_pools_segment_is_refused() -> None:
    with ShmPool(4096, slots=4) as a, ShmPool(4096, slots=4) as b:
        for made in (a, b):
            made.bind(owner=0, consumers=[1])
        forged = dataclasses.replace(b.descriptor(), handle=a.descriptor().handle)
        registry = PoolRegistry(1)
        with pytest.raises(IpcError, match="segment"):
            registry.add(forged)
        assert registry.opens == {} and a.holders() == []
        registry.close()


def test_a_segment_owned_by_another_user_is_not_mapped(
    pool: ShmPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real + 1)
    registry = PoolRegistry(1)
    with pytest.raises(IpcError, match="owned by uid"):
        registry.add(pool.descriptor())
    assert registry.opens == {} and pool.holders() == []
    registry.close()


class _CloseFirst:
    """A lock whose first acquisition lets ``registry.close()`` run to completion
    first (the interleaving of a close between an ``add``'s checks and its lock)."""

    def __init__(self, registry: PoolRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._first = True

    def __enter__(self) -> None:
        if self._first:
            self._first = False
            closer = threading.Thread(target=self._registry.close)
            closer.start()
            closer.join(10)
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_registry_closed_during_add_maps_nothing(pool: ShmPool) -> None:
    registry = PoolRegistry(1)
    registry._lock = _CloseFirst(registry)  # type: ignore[assignment]
    with pytest.raises(IpcError, match="closed"):
        registry.add(pool.descriptor())
    assert registry.opens == {} and pool.holders() == []


def test_a_second_live_mapping_as_the_same_consumer_is_refused(pool: ShmPool) -> None:
    first, second = PoolRegistry(1), PoolRegistry(1)
    first.add(pool.descriptor())
    with pytest.raises(IpcError, match="already mapped by pid"):
        second.add(pool.descriptor())
    assert second.opens == {}
    ref = pool.put(torch.arange(3.0), consumers=[1])
    assert ref is not None
    assert torch.equal(first.fetch(ref), torch.arange(3.0))
    first.close()
    second.add(pool.descriptor())  # the consumer's row is free again once it left
    assert pool.holders() == [1]
    second.close()
