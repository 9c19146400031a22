"""Node-leader all-gathers (comm/_tree.py) and the counting communicator, over thread-ranks."""

from __future__ import annotations

from typing import Any

from distcache.comm import (
    Communicator,
    CountingCommunicator,
    NodeTree,
    ThreadGroup,
    Traffic,
    node_tree,
)
from distcache.comm._codec import encode
from tests.unit.test_comm_local import run_ranks


def _nodes(count: int, per_node: int) -> list[str]:
    return [f"n{r // per_node}" for r in range(count * per_node)]


def test_the_tree_returns_what_a_flat_allgather_does_element_for_element() -> None:
    group = ThreadGroup(8, _nodes(4, 2))

    def body(comm: Communicator) -> tuple[list[Any], list[Any], bool]:
        tree = NodeTree(comm).selected()
        payload = {"node": comm.node_id, "rank": comm.rank % 3, "blob": b"x" * comm.rank}
        flat = comm.allgather_object(payload)
        routed = tree.allgather_object(payload)
        routed[0]["node"] = "changed"  # entries are decoded on their own
        return flat, tree.allgather_object(payload), isinstance(tree, NodeTree)

    for flat, routed, is_tree in run_ranks(group, body):
        assert is_tree
        assert routed == flat
        assert [p["rank"] for p in routed] == [r % 3 for r in range(8)]


def test_one_rank_per_node_or_one_node_uses_the_communicator_itself() -> None:
    for node_ids in (_nodes(4, 1), _nodes(1, 4)):
        group = ThreadGroup(4, node_ids)
        results = run_ranks(group, lambda c: NodeTree(c).selected() is c)
        assert results == [True] * 4


def test_in_process_ranks_keep_their_communicator() -> None:
    group = ThreadGroup(4, _nodes(2, 2))
    assert run_ranks(group, lambda c: node_tree(c) is c) == [True] * 4


class _Process(CountingCommunicator):
    """Thread-ranks that present themselves as ranks of separate processes."""

    @property
    def backend(self) -> str:
        return "mpi"


def test_the_tree_is_made_once_per_communicator() -> None:
    group = ThreadGroup(4, _nodes(2, 2))

    def body(comm: Communicator) -> tuple[bool, bool]:
        counted = _Process(comm)
        tree = node_tree(counted)
        return isinstance(tree, NodeTree), tree is node_tree(counted)

    assert run_ranks(group, body) == [(True, True)] * 4


def _received(per_node: int, nodes: int, payload: Any) -> tuple[int, int]:
    group = ThreadGroup(nodes * per_node, _nodes(nodes, per_node))

    def body(comm: Communicator) -> tuple[int, int]:
        counted = CountingCommunicator(comm, Traffic())
        tree = NodeTree(counted).selected()
        before = counted.traffic.snapshot()
        tree.allgather_object(payload(comm))
        after = counted.traffic.snapshot()
        return after[0] - before[0], after[1] - before[1]

    figures = run_ranks(group, body)
    return max(s for s, _ in figures), max(r for _, r in figures)


def test_per_node_payloads_cost_a_rank_the_same_at_two_and_eight_ranks_per_node() -> None:
    def per_node(comm: Communicator) -> Any:
        return ("pool-" + comm.node_id, b"\xff" * 64)

    sent2, received2 = _received(2, 4, per_node)
    sent8, received8 = _received(8, 4, per_node)
    # Eight ranks per node add six more members' payloads at the leader, nothing else.
    one = len(encode(("pool-n0", b"\xff" * 64)))  # one payload
    assert received8 <= received2 + 6 * 2 * one
    assert sent8 <= sent2 + 2 * one


def test_a_flat_allgather_grows_with_the_ranks_where_the_tree_does_not() -> None:
    def body(comm: Communicator) -> int:
        counted = CountingCommunicator(comm)
        counted.allgather_object(("pool-" + comm.node_id, b"\xff" * 64))
        return counted.traffic.received

    small = max(run_ranks(ThreadGroup(8, _nodes(4, 2)), body))
    large = max(run_ranks(ThreadGroup(32, _nodes(4, 8)), body))
    assert large >= 4 * small


def test_counting_counts_broadcasts_once_at_the_root_and_splits_agreement() -> None:
    group = ThreadGroup(3)

    def body(comm: Communicator) -> tuple[int, int, dict[str, int]]:
        counted = CountingCommunicator(comm)
        counted.broadcast_bytes(b"abcd" if comm.rank == 1 else None, 1)
        child = counted.split(0)
        child.barrier()
        return counted.traffic.sent, counted.traffic.received, counted.traffic.calls

    results = run_ranks(group, body)
    split_part = results[0][0]  # rank 0 sent only its split's color
    assert results[1][0] == 4 + split_part
    assert results[0][1] == 4 + 2 * split_part
    assert results[1][1] == 2 * split_part
    assert results[0][2] == {"broadcast_bytes": 1, "split": 1, "barrier": 1}


def test_the_mpi_arrival_tree_reaches_every_rank_once_with_few_peers_each() -> None:
    from distcache.comm._arrival import _arrival_tree, _subtree

    for size in (1, 2, 3, 7, 8, 9, 64, 255, 256, 4096):
        reached = {0}
        for rank in range(size):
            parent, children = _arrival_tree(rank, size)
            assert (parent is None) == (rank == 0)
            for child in children:
                assert _arrival_tree(child, size)[0] == rank
                assert child not in reached
                reached.add(child)
            # At most log2(size) + 1 peers per rank, at any size.
            assert len(children) + (parent is not None) <= max(size - 1, 1).bit_length() + 1
        assert reached == set(range(size))
    # A child's subtree is a contiguous range, which is how a timeout names it.
    assert [_subtree(c, 8) for c in _arrival_tree(0, 8)[1]] == ["1", "2-3", "4-7"]
    assert _subtree(4, 6) == "4-5"


def test_alike_payloads_are_decoded_once_and_mutable_ones_stay_apart() -> None:
    group = ThreadGroup(8, _nodes(4, 2))

    def body(comm: Communicator) -> tuple[bool, list[Any], list[Any]]:
        tree = NodeTree(comm).selected()
        frozen = tree.allgather_object(("pool", comm.node_id, None))
        lists = tree.allgather_object(["pool", comm.node_id])
        lists[0].append("changed")
        return frozen[0] is frozen[1], frozen, lists

    for shared, frozen, lists in run_ranks(group, body):
        assert shared  # one decoded tuple for the ranks of node n0
        assert frozen == [("pool", f"n{r // 2}", None) for r in range(8)]
        assert lists[0] == ["pool", "n0", "changed"]
        assert lists[1:] == [["pool", f"n{r // 2}"] for r in range(1, 8)]


def test_the_node_layout_comes_from_the_tree_without_a_collective_of_its_own() -> None:
    from distcache.comm import node_layout

    group = ThreadGroup(6, _nodes(3, 2))

    def body(comm: Communicator) -> tuple[tuple[int, bool], tuple[int, bool], int]:
        counting = CountingCommunicator(comm)
        flat = node_layout(counting)  # in-process ranks: one all-gather of the node ids
        tree = NodeTree(counting)
        before = sum(counting.traffic.calls.values())
        routed = node_layout(tree)
        return flat, routed, sum(counting.traffic.calls.values()) - before

    for rank, (flat, routed, calls) in enumerate(run_ranks(group, body)):
        assert flat == routed == (3, rank % 2 == 0)
        assert calls == 0
