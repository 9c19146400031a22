"""A lookup made while the tier's start-up is still finishing: a node member whose
share of the endpoints returned (its tier attached) before its leader joined the
node's agent to the job's. Its lookup is held until the join, then walks the whole
ring: the artifact another node owns is asked of that node, and the origin sees one
request for it in the job, not one per node."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.comm import ThreadGroup
from distcache.origins import HttpOrigin
from distcache.peer import Agent, _hosting, lookup, order
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts

SECRET = b"s" * 32


def _in_threads(work: Any, ranks: int) -> list[Any]:
    out: list[Any] = [None] * ranks
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.timeout(120)
def test_a_member_lookup_before_its_leader_joins_the_agent_waits_and_asks_the_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = make_artifacts(tmp_path / "repo", 16, min_size=500, max_size=1_000)
    nodes = ["node-a", "node-a", "node-b", "node-b"]
    group = ThreadGroup(4, nodes, timeout=30)
    with LoopbackOrigin(tmp_path / "repo") as origin:
        began = _in_threads(lambda r: _hosting.begin(
            group.comm(r), ArtifactPool(tmp_path / nodes[r]),
            lambda: HttpOrigin(origin.url), SECRET, timeout=30), 4)
        held = began[0]._started()  # node-a's agent, started, not yet joined
        assert held is not None and began[1]._started() is None
        release, joining = threading.Event(), threading.Event()
        join = Agent.join

        def held_join(agent: Agent, ring: Any, me: int) -> None:
            if agent is held:  # node-a's leader is slow to join its agent
                joining.set()
                release.wait(30)
            join(agent, ring, me)

        monkeypatch.setattr(Agent, "join", held_join)
        finished: list[Any] = [None] * 4

        def finish(rank: int) -> None:
            finished[rank] = began[rank].finish()

        threads = [threading.Thread(target=finish, args=(r,), daemon=True) for r in range(4)]
        for t in threads:
            t.start()
        threads[1].join(30)  # the member's share returned: its tier is attached
        assert joining.wait(30) and not release.is_set()
        member = finished[1]
        assert member is not None and member.tier is not None
        ring = list(member.nodes)
        theirs = [a for a in made if order(a.sha256, ring)[0] != ring.index(held.endpoint)]
        asked: list[Artifact] = theirs[:2]
        assert len(asked) == 2
        got: list[Any] = []
        looking = threading.Thread(
            target=lambda: got.extend(lookup(a, member.tier) for a in asked), daemon=True)
        looking.start()
        looking.join(0.5)  # held at the agent that knows no other node
        assert origin.total_requests == 0
        release.set()
        looking.join(60)
        for t in threads:
            t.join(30)
        try:
            assert not looking.is_alive()
            assert [g and g.source for g in got] == ["peer", "peer"]
            assert origin.total_requests == 2  # the owner's only
        finally:
            for hosted in finished:
                if hosted is not None:
                    hosted.close()
