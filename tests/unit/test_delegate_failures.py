"""Failures in the node leaders' prefetch (distcache/_delegate.py) after ``lead``
itself: what rides along fails, or a leader does not come to it; and the node
tree's communicators that a failure lets go of (distcache/comm/_tree.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from distcache._delegate import led_by_node_leaders
from distcache.comm import Communicator, NodeTree, ThreadGroup, node_tree
from distcache.comm._tree import forget_tree
from distcache.errors import CollectiveTimeout, WireError
from distcache.store import ArtifactPool
from tests.support.helpers import node_pools
from tests.support.threads import run_ranks
from tests.unit.test_comm_edges import _Threaded

#: What a member waits for its leader's word; every failure below is handed down
#: well within it.
TIMEOUT = 3.0
NODES = ["a", "a", "b", "b"]


@pytest.fixture
def pools(tmp_path: Path) -> dict[str, Path]:
    return node_pools(tmp_path, NODES)


def _forged(leaders: Communicator) -> Any:
    raise WireError("the node agents' endpoints from rank 1 are forged",
                    op="allgather_object", rank=leaders.rank, peer=1)


class _Aside:
    """Rides along; ``among_leaders`` runs ``fails`` on the leaders it names (by their
    rank among the leaders), an all-gather on the others."""

    def __init__(self, failing: dict[int, Any], wait: float = TIMEOUT) -> None:
        self.failing, self.wait, self.got = failing, wait, None

    def among_leaders(self, leaders: Communicator) -> Any:
        fails = self.failing.get(leaders.rank)
        if fails is not None:
            return fails(leaders)
        return leaders.allgather_object(leaders.rank, timeout=self.wait)

    def received(self, data: Any) -> None:
        self.got = data


def _led(pools: dict[str, Path], make_aside: Any, lead: Any = None) -> list[Any]:
    """``led_by_node_leaders`` on 4 thread-ranks on 2 nodes; each rank's result or
    error, and the seconds it took."""
    group = ThreadGroup(4, NODES, timeout=TIMEOUT)

    def body(comm: Communicator) -> tuple[Any, float]:
        tree = NodeTree(comm, timeout=TIMEOUT)
        pool = ArtifactPool(pools[comm.node_id])
        start = time.monotonic()
        try:
            got: Any = led_by_node_leaders(tree, pool, "inputs", timeout=TIMEOUT,
                                           lead=lead or (lambda leaders: None),
                                           aside=make_aside())
        except Exception as exc:
            got = exc
        return got, time.monotonic() - start

    return run_ranks(group, body, limit=4 * TIMEOUT)


def test_what_rides_along_failing_on_the_leaders_reaches_every_member(
        pools: dict[str, Path]) -> None:
    out = _led(pools, lambda: _Aside({0: _forged, 1: _forged}))
    for rank, (got, took) in enumerate(out):
        assert isinstance(got, WireError), (rank, got)
        assert "endpoints from rank 1 are forged" in str(got), (rank, got)
        assert took < TIMEOUT / 2, (rank, took)  # a hang guard: handed down, not waited out


def test_a_leader_that_never_comes_to_what_rides_along_fails_each_node_with_its_cause(
        pools: dict[str, Path]) -> None:
    # Node b's leader fails at once; node a's waits for it among the leaders for a
    # second (less than the members' timeout) and hands the timeout down its node.
    out = _led(pools, lambda: _Aside({1: _forged}, wait=1.0))
    for rank in (2, 3):
        got = out[rank][0]
        assert isinstance(got, WireError) and "forged" in str(got), (rank, got)
    for rank in (0, 1):
        got = out[rank][0]
        # The leader's timeout among the leaders (1 s, named as rank 0 of the job),
        # not the member's own wait for a silent leader (3 s, on the node's rank 1).
        assert isinstance(got, CollectiveTimeout), (rank, got)
        assert (getattr(got, "rank", None), getattr(got, "timeout", None)) == (0, 1.0), got
        assert "rank 0/4" in str(got), (rank, got)


def test_the_ranks_keep_in_step_after_a_failure_handed_down(pools: dict[str, Path]) -> None:
    group = ThreadGroup(4, NODES, timeout=TIMEOUT)

    def body(comm: Communicator) -> Any:
        tree = NodeTree(comm, timeout=TIMEOUT)
        with pytest.raises(WireError):
            led_by_node_leaders(tree, ArtifactPool(pools[comm.node_id]), "inputs",
                                timeout=TIMEOUT, lead=lambda leaders: None,
                                aside=_Aside({0: _forged, 1: _forged}))
        # A later collective over every rank, and another leaders' prefetch, agree.
        again = NodeTree(comm, timeout=TIMEOUT)
        led = led_by_node_leaders(again, ArtifactPool(pools[comm.node_id]), "inputs",
                                  timeout=TIMEOUT, lead=lambda leaders: None,
                                  aside=_Aside({}))
        return comm.allgather_object(comm.rank, timeout=TIMEOUT), led

    for gathered, led in run_ranks(group, body, limit=4 * TIMEOUT):
        assert gathered == [0, 1, 2, 3]
        assert led == (None,)


# -- the tree's communicators --------------------------------------------------------


class _Closing(_Threaded):
    """A backend over thread-ranks that records the communicators closed (its
    children are of this class too)."""

    _kind = "closing-threads"

    def close(self) -> None:
        if self.usable:
            CLOSED.append(self)
        super().close()


CLOSED: list[_Closing] = []


def _failing_lead(leaders: Communicator) -> Any:
    raise WireError("the leaders' prefetch failed", op="allgather_object", rank=leaders.rank)


def test_a_failed_prefetch_closes_the_communicators_of_the_tree_it_let_go(
        pools: dict[str, Path]) -> None:
    CLOSED.clear()
    group = ThreadGroup(4, NODES, timeout=TIMEOUT)

    def body(comm: Communicator) -> Any:
        base = _Closing(group, comm.rank, timeout=TIMEOUT, node_id=comm.node_id)
        trees = []
        for _ in range(2):  # two failed prefetches on one long-lived communicator
            tree = node_tree(base, timeout=TIMEOUT)
            assert isinstance(tree, NodeTree)
            trees.append(tree)
            with pytest.raises(WireError, match="prefetch failed"):
                led_by_node_leaders(tree, ArtifactPool(pools[comm.node_id]), "inputs",
                                    timeout=TIMEOUT, lead=_failing_lead)
        made = [c for t in trees for c in t.levels()]
        return made, list(base._owned_children), base

    out = run_ranks(group, body, limit=4 * TIMEOUT)
    for made, owned, base in out:
        assert len(made) == 4 and len({id(c) for c in made}) == 4  # a fresh tree each time
        assert all(any(c is d for d in CLOSED) for c in made)
        assert not any(c.usable for c in made)
        assert owned == []  # closed: no longer kept for the base's own close
        assert base.usable
    # Each rank closed its two communicators of each tree, once.
    assert len(CLOSED) == 4 * 2 * 2

    # A plain split's child is the wrapped communicator's (handed out again): a tree
    # that lets go of it leaves it open.
    plain = ThreadGroup(4, NODES, timeout=TIMEOUT)

    class _PlainSplit(_Threaded):
        split_owned = None  # type: ignore[assignment]

    def split_only(comm: Communicator) -> bool:
        base = _PlainSplit(plain, comm.rank, timeout=TIMEOUT, node_id=comm.node_id)
        tree = NodeTree(base, timeout=TIMEOUT)
        forget_tree(tree)
        return all(getattr(c, "usable", False) for c in tree.levels())

    assert run_ranks(plain, split_only, limit=4 * TIMEOUT) == [True] * 4


class _Broken:
    """An integration whose usage record cannot be read on this rank: its
    ``manifest()`` raises what is no error of distcache's."""

    name = "broken"

    def manifest(self) -> list[Any]:
        raise ValueError("usage record is corrupt JSON")


@pytest.mark.parametrize("how", ["nul in a manifest path", "an integration's defect"])
def test_one_ranks_unreadable_input_fails_every_rank_at_once_naming_it(
        pools: dict[str, Path], tmp_path: Path, how: str) -> None:
    from distcache._resolve import prefetch_manifests

    sha = ArtifactPool(pools["a"]).put(b"x" * 10)
    ArtifactPool(pools["b"]).put(b"x" * 10)
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(f"{sha}  k.bin\n")
    group = ThreadGroup(4, NODES, timeout=30)

    def body(comm: Communicator) -> Exception | None:
        odd = comm.rank == 3
        spec = str(manifest) + ("\0" if odd and how.startswith("nul") else "")
        integrations = [_Broken()] if odd and not how.startswith("nul") else []
        try:
            prefetch_manifests(NodeTree(comm, timeout=30), ArtifactPool(pools[comm.node_id]),
                               None, manifests=[spec], integrations=integrations,
                               timeout=30)
        except Exception as exc:
            return exc
        return None

    # Before, the other ranks waited out the timeout and raised CollectiveTimeout.
    cause = "embedded null byte" if how.startswith("nul") else "usage record is corrupt"
    for rank, error in enumerate(run_ranks(group, body, limit=60)):
        assert error is not None and cause in str(error), (rank, error)
