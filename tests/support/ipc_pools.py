"""The host shared-memory pool the in-process IPC tests share, with a registry for
each of its consumer ranks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from distcache.ipc import PoolRegistry, ShmPool


def pool_fixtures() -> tuple[object, object]:
    """Two fixtures for a test module to bind to the names ``pool`` and ``readers``
    (``pool, readers = pool_fixtures()``): a 64 KiB pool of 8 slots bound to owner 0
    and consumers 1 and 2, and a registry per consumer rank that has added it, closed
    after the test."""

    @pytest.fixture
    def pool() -> Iterator[ShmPool]:
        with ShmPool(1 << 16, slots=8) as made:
            made.bind(owner=0, consumers=[1, 2])
            yield made

    @pytest.fixture
    def readers(pool: ShmPool) -> Iterator[dict[int, PoolRegistry]]:
        made = {rank: PoolRegistry(rank) for rank in (1, 2)}
        for registry in made.values():
            registry.add(pool.descriptor())
        yield made
        for registry in made.values():
            registry.close()

    return pool, readers
