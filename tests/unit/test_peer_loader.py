"""The FlashInfer loader's miss path through the peer tier: counted by where the bytes
came from, in the loader statistics and the JSON event log; bounded and never raising
when the tier is gone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.integrations.flashinfer import PooledLoader
from distcache.origins import HttpOrigin
from distcache.peer import Agent, Tier, attach, derive_key, host_agent, owner
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts

KEY = derive_key(b"q" * 32)


def _never(*_: Any) -> bytes:
    raise AssertionError("FlashInfer's own loader must not be asked")


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, ...]]:
    made = make_artifacts(tmp_path / "repo", 8, min_size=1_000, max_size=3_000)
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(tmp_path / "events.jsonl"))
    with LoopbackOrigin(tmp_path / "repo") as origin:
        agents = [host_agent(ArtifactPool(tmp_path / f"pool{i}"),
                             lambda: HttpOrigin(origin.url), KEY, f"n{i}") for i in range(2)]
        endpoints = [a.endpoint for a in agents]
        for i, agent in enumerate(agents):
            agent.join(endpoints, i)
        try:
            yield made, origin, agents, tmp_path
        finally:
            attach(None)
            for agent in agents:
                agent.stop()


def _loader(agent: Agent, origin: LoopbackOrigin) -> PooledLoader:
    attach(Tier(agent.local_endpoint or "", KEY, bound=10))
    return PooledLoader(agent.pool, _never, origin=HttpOrigin(origin.url))


def test_misses_on_two_nodes_cost_one_origin_request_each_and_are_counted_by_source(
    setup: tuple[Any, ...]
) -> None:
    made, origin, agents, tmp_path = setup
    endpoints = [a.endpoint for a in agents]
    first = _loader(agents[0], origin)
    assert all(sha256_hex(first(a.name, a.sha256)) == a.sha256 for a in made)
    owned = sum(owner(a.sha256, endpoints) == 0 for a in made)
    assert (first.stats.fetched, first.stats.peer) == (owned, len(made) - owned)
    second = _loader(agents[1], origin)
    assert all(sha256_hex(second(a.name, a.sha256)) == a.sha256 for a in made)
    assert origin.total_requests == len(made)
    assert second.stats.peer + second.stats.hits == len(made)
    assert second.stats.fetched == 0 and second.stats.peer_failed == 0
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    sources = [e["source"] for e in events if e.get("event") == "flashinfer.lookup"]
    assert sorted(set(sources)) <= ["origin", "peer", "pool"] and len(sources) >= len(made)


def test_a_gone_agent_costs_one_bounded_fallback_to_the_origin_and_never_raises(
    setup: tuple[Any, ...]
) -> None:
    made, origin, agents, _ = setup
    loader = _loader(agents[0], origin)
    agents[0].stop()
    artifact: Artifact = made[0]
    assert sha256_hex(loader(artifact.name, artifact.sha256)) == artifact.sha256
    assert (loader.stats.peer_failed, loader.stats.fetched, loader.stats.fallbacks) == (1, 1, 0)
    assert origin.total_requests == 1


def test_an_owner_without_a_configured_origin_fills_from_flashinfers_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.peer import lookup, origin_or_default

    made = make_artifacts(tmp_path / "repo", 2, min_size=1_000, max_size=2_000)
    monkeypatch.delenv("DISTCACHE_ORIGIN", raising=False)
    with LoopbackOrigin(tmp_path / "repo") as origin:
        monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", origin.url)
        agent = host_agent(ArtifactPool(tmp_path / "pool"), origin_or_default(None), KEY, "n")
        agent.join([agent.endpoint], 0)  # as the job's start joins it
        try:
            got = lookup(made[0], Tier(agent.local_endpoint or "", KEY, bound=10))
        finally:
            agent.stop()
        assert got is not None and got.source == "origin"
        assert origin.total_requests == 1
