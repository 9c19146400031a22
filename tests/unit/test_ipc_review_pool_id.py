"""A pool id already mapped from one owner is not taken over by another owner's pool.

``registry.add`` took any later epoch of a mapped pool id as its producer's restart.
A second producer that chose the same name (an outside tokenizer named like a rank's
pool) thus replaced the live pool's mapping: the consumer left the live pool (its
leases released unread) and every ref of it was refused as "the producer
restarted". A producer keeps its owner across a restart, so a descriptor of the same
id from another owner is refused instead, naming both; a restart of the same owner
is still followed (the guard).
"""

from __future__ import annotations

import os

import pytest
import torch

from distcache.errors import IpcError
from distcache.ipc import PoolRegistry, ShmPool


def test_another_owners_pool_of_the_same_id_does_not_replace_the_mapping() -> None:
    name = f"same{os.getpid()}"
    with ShmPool(4096, slots=4, name=name) as live, ShmPool(4096, slots=4, name=name) as other:
        live.bind(owner=0, consumers=[1])
        other.bind(owner=None, consumers=[1])
        registry = PoolRegistry(1)
        registry.add(live.descriptor())
        ref = live.put(torch.arange(4.0))
        assert ref is not None
        with pytest.raises(IpcError, match=rf"pool {name} .*rank 0.*outside the group"):
            registry.add(other.descriptor().pack())
        carried = other.put(torch.ones(2), with_descriptor=True)
        assert carried is not None and carried.descriptor is not None
        with pytest.raises(IpcError, match="rank 0"):
            registry.add(carried.descriptor)
        assert registry.opens == {name: 1}
        assert torch.equal(registry.fetch(ref), torch.arange(4.0))
        assert live.reclaim() == 1
        registry.close()


def test_a_restart_of_the_same_owner_is_still_remapped() -> None:
    name = f"again{os.getpid()}"
    with ShmPool(4096, slots=4, name=name) as first:
        first.bind(owner=0, consumers=[1])
        registry = PoolRegistry(1)
        registry.add(first.descriptor())
    with ShmPool(4096, slots=4, name=name) as second:
        second.bind(owner=0, consumers=[1])
        ref = second.put(torch.arange(3.0), with_descriptor=True)
        assert ref is not None
        assert torch.equal(registry.fetch(ref), torch.arange(3.0))
        assert registry.opens == {name: 2}
        registry.close()
