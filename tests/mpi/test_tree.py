"""Node-leader all-gathers (distcache.comm.node_tree) over a real backend, 2 ranks per
simulated node."""

from __future__ import annotations

from collections.abc import Callable

from distcache.comm import Communicator, NodeTree, node_tree


def test_the_tree_answers_as_a_flat_allgather_on_communicators_of_its_own(
        comm: Communicator, comm_factory: Callable[..., Communicator]) -> None:
    made = comm_factory(node_id=f"sim{comm.rank // 2}")
    try:
        tree = node_tree(made)
        if made.size < 4:
            assert tree is made
            return
        assert isinstance(tree, NodeTree) and tree is node_tree(made)
        payload = (made.node_id, b"\x01" * (made.rank % 2), made.rank // 3)
        assert tree.allgather_object(payload) == made.allgather_object(payload)
        # The collective splits off the leaders as its writers, and moves buckets on
        # that communicator while the tree carries heartbeats: never one object.
        writers = made.split(0 if tree.is_leader else 1)
        assert all(writers is not c for c in (tree._local, tree._upper))
        assert writers.allgather_object(made.rank) != []
        assert tree.allgather_object(None) == [None] * made.size
    finally:
        close = getattr(made, "close", None)
        if close is not None:
            close()
