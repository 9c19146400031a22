"""A malformed payload from one rank in the node tree's all-gather (a member's part
that is not encoded bytes, distcache/comm/_tree.py) and in the node leaders' vote
(distcache/_delegate.py): every rank ends alike, none waits out its timeout."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from distcache._delegate import led_by_node_leaders
from distcache.collective import PrefetchReport
from distcache.comm import Communicator, NodeTree, ThreadGroup
from distcache.comm._base import Forwarding
from distcache.errors import CollectiveTimeout, WireError
from distcache.store import ArtifactPool
from tests.support.helpers import node_pools
from tests.support.threads import run_ranks

#: Short enough that a rank left waiting shows as a CollectiveTimeout in the results.
TIMEOUT = 3.0
NODES = ["a", "a", "b", "b"]


class _Replacing(Forwarding):
    """A communicator whose first all-gather sends ``sent`` instead of what its
    caller passed (a rank whose payload decodes fine but has the wrong shape); the
    later ones go through unchanged."""

    def __init__(self, base: Communicator, sent: Any) -> None:
        self._base, self.sent, self.replaced = base, sent, False

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        if not self.replaced:
            self.replaced, obj = True, self.sent
        return self._base.allgather_object(obj, timeout=timeout)


class _OneRankSends(NodeTree):
    """A node tree on which rank ``who`` sends ``sent`` as its first payload on the
    node's communicator (``upper=False``) or on the leaders' (``upper=True``)."""

    who = -1
    sent: Any = None
    upper = False

    def levels(self) -> tuple[Communicator, Communicator | None]:
        local, upper = super().levels()
        if self.rank != self.who:
            return local, upper
        if self.upper:
            assert upper is not None
            return local, _Replacing(upper, self.sent)
        return _Replacing(local, self.sent), upper


def _tree(comm: Communicator, who: int, sent: Any, *, upper: bool = False) -> NodeTree:
    tree = _OneRankSends(comm, timeout=TIMEOUT)
    tree.who, tree.sent, tree.upper = who, sent, upper
    return tree


def _gathered(who: int, sent: Any) -> list[Any]:
    """``allgather_object`` of each rank's rank on 4 thread-ranks on 2 nodes, rank
    ``who`` sending ``sent`` as its part; each rank's result or error."""
    group = ThreadGroup(4, NODES, timeout=TIMEOUT)
    return run_ranks(group, lambda comm: _tree(comm, who, sent).allgather_object(
        comm.rank, timeout=TIMEOUT), limit=4 * TIMEOUT)


@pytest.mark.parametrize("who", [1, 3])
@pytest.mark.parametrize("sent", ["not bytes", None, [b"x"]])
def test_a_members_part_that_is_not_bytes_is_one_wire_error_on_every_rank(
        who: int, sent: Any) -> None:
    out = _gathered(who, sent)
    assert not any(isinstance(r, CollectiveTimeout) for r in out), out
    assert all(isinstance(r, WireError) for r in out), out
    # Every rank names the member that sent it, in the same words.
    reasons = {str(r).split(": ", 1)[1] for r in out}
    assert reasons == {f"rank {who} sent a part that is not an encoded payload"}, out


def test_a_members_part_that_is_an_int_allocates_nothing_on_its_leader() -> None:
    tracemalloc.start()
    try:
        out = _gathered(1, 64 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated for a part that is an int"
    assert all(isinstance(r, WireError) and "rank 1 sent a part" in str(r)
               for r in out), out


@pytest.fixture
def pools(tmp_path: Path) -> dict[str, Path]:
    return node_pools(tmp_path, NODES)


def _report(leaders: Communicator) -> PrefetchReport:
    """What the leaders' prefetch did, naming both leaders (by their rank among the
    leaders) as writers and the second as a downloader."""
    return PrefetchReport(
        operation="prefetch", artifacts=0, objects=0, downloads=0, origin_bytes=0,
        broadcasts=0, broadcast_bytes=0, received_bytes=0, discarded_bytes=0,
        pool_hits=0, objects_published=0, pools=2, writers=(0, 1), downloaders=(1,),
        peak_bytes=0, seconds={})


def _led(pools: dict[str, Path], vote: Any) -> list[Any]:
    """``led_by_node_leaders`` on 4 thread-ranks on 2 nodes whose ranks share their
    node's pool and inputs, node b's leader (rank 2) voting ``vote``; each rank's
    result or error."""
    group = ThreadGroup(4, NODES, timeout=TIMEOUT)

    def body(comm: Communicator) -> Any:
        tree = _tree(comm, 2, vote, upper=True)
        return led_by_node_leaders(tree, ArtifactPool(pools[comm.node_id]), "inputs",
                                   timeout=TIMEOUT, lead=_report)

    return run_ranks(group, body, limit=4 * TIMEOUT)


def test_honest_votes_leave_the_prefetch_to_the_leaders(pools: dict[str, Path]) -> None:
    out = _led(pools, (True, 2))
    assert all(type(r) is tuple for r in out), out
    assert {(r[0].writers, r[0].downloaders) for r in out} == {((0, 2), (2,))}, out


@pytest.mark.parametrize("vote", [
    (True,),      # no rank: the leaders read past the vote
    (True, -7),   # a rank that is no rank of the job
    (True, 0),    # another leader's rank
    (True, 2.0),  # the right rank, not as an int
])
def test_a_malformed_vote_sends_every_rank_to_the_full_collective(
        pools: dict[str, Path], vote: Any) -> None:
    out = _led(pools, vote)
    assert not any(isinstance(r, BaseException) for r in out), out
    # None on every rank: nothing was prefetched by the leaders, and no report names
    # a rank taken from the vote.
    assert out == [None] * 4, out
