"""A pool made with consumers that are not ranks of its node is refused at exchange.

``ShmPool(..., consumers=[5])`` in a job without rank 5, or naming a rank of another
node, was accepted: that consumer never maps the pool nor acknowledges, so the pool
filled for good (every put waiting) with one warning. The exchange now raises an
``IpcError`` naming them on every rank; consumers among the node's other ranks are
taken as before (the guard).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from distcache.comm import ThreadGroup
from distcache.errors import IpcError
from distcache.ipc import PoolRegistry, ShmPool

pytest.importorskip("torch")


def _exchange(nodes: list[str], consumers: list[int] | None, tag: str) -> list[Any]:
    """Each rank exchanges a pool (rank 0's made with ``consumers``); what each got."""
    group = ThreadGroup(len(nodes), node_ids=nodes, timeout=60)
    results: list[Any] = [None] * len(nodes)

    def main(rank: int) -> None:
        comm = group.comm(rank)
        pool = ShmPool(4096, name=f"{tag}{rank}", consumers=consumers if rank == 0 else None)
        try:
            registry = PoolRegistry.exchange(comm, [pool])
            results[rank] = ("mapped", pool.consumers)
            registry.close()
        except IpcError as exc:
            results[rank] = ("refused", str(exc))
        finally:
            pool.close()

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.mark.parametrize("consumers", [[5], [2], [1, 3]])
def test_consumers_outside_the_owners_node_are_refused_on_every_rank(
    consumers: list[int],
) -> None:
    results = _exchange(["a", "a", "b", "b"], consumers, f"stray{len(consumers)}{consumers[0]}")
    assert all(kind == "refused" for kind, _ in results), results
    assert "are not ranks of this node's job" in results[0][1]


def test_consumers_among_the_nodes_other_ranks_are_taken() -> None:
    results = _exchange(["a", "a", "a", "b"], [2], "kept")
    assert results[0] == ("mapped", (2,)), results
    assert all(kind == "mapped" for kind, _ in results), results
