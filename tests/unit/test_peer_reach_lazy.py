"""Which node agents a rank can reach is worked out where it is needed: by the ranks
that host an agent (their ring) and rank 0 (its warning) at start-up, by any other
rank only when it asks for the list, never by probing every other node's socket from
every rank of the job."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from distcache.peer import _reach
from distcache.peer._auth import derive_key
from distcache.peer._hosting import Starting, host_agent
from distcache.store import ArtifactPool

KEY = derive_key(b"r" * 32)


class _Leaders:
    """The node leaders' all-gather as rank ``rank`` sees it, answered with
    ``entries`` (no collective)."""

    def __init__(self, node_id: str, rank: int, entries: list[tuple[str, str, str]]) -> None:
        self.node_id, self.rank, self.size, self.entries = node_id, rank, 8, entries

    def allgather_object(self, obj: object, *, timeout: float | None = None) -> object:
        return self.entries


def _probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    probed: list[str] = []
    real = _reach._on_this_host

    def counting(unix: str) -> bool:
        probed.append(unix)
        return real(unix)

    monkeypatch.setattr(_reach, "_on_this_host", counting)
    return probed


def test_a_rank_hosting_no_agent_probes_no_other_node_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    loopback = {"MASTER_ADDR": "127.0.0.1"}  # every agent on 127.0.0.1: probes needed
    agents = [host_agent(ArtifactPool(tmp_path / f"pool-{n}"), lambda: None, KEY, n, loopback)
              for n in ("node-a", "node-b", "node-c")]
    try:
        entries = [(n, a.endpoint, a.local_endpoint or "")
                   for n, a in zip(("node-a", "node-b", "node-c"), agents, strict=True)]
        # A node simulated elsewhere: its socket is gone, so its loopback is not ours.
        entries.append(("node-d", "tcp://127.0.0.1:9", f"unix:{tmp_path / 'gone.sock'}"))
        probed = _probes(monkeypatch)
        member = Starting(_Leaders("node-b", 3, entries), KEY, 5.0, None).finish()  # type: ignore[arg-type]
        try:
            assert probed == []
            # Its own node's agent is its tier, found without a probe.
            assert member.tier is not None and member.tier.endpoint == entries[1][2]
            # Asked for, the list is what a probing rank works out, once.
            assert member.nodes == [a.endpoint for a in agents]
            assert len(probed) == 3 and member.nodes == [a.endpoint for a in agents]
            assert len(probed) == 3
        finally:
            member.close()
        # Only rank 0 names the unreachable node (once for the job, not per rank).
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
        probed.clear()
        first = Starting(_Leaders("node-a", 0, entries), KEY, 5.0, None).finish()  # type: ignore[arg-type]
        try:
            assert len(probed) == 3
            assert first.nodes == [a.endpoint for a in agents]
            said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(said) == 1 and "node node-d at tcp://127.0.0.1:9" in said[0]
        finally:
            first.close()
    finally:
        for agent in agents:
            agent.stop()


def test_a_rank_hosting_an_agent_joins_the_ring_of_the_nodes_it_reaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    loopback = {"MASTER_ADDR": "127.0.0.1"}
    pool = ArtifactPool(tmp_path / "pool-b")
    other = host_agent(ArtifactPool(tmp_path / "pool-a"), lambda: None, KEY, "node-a", loopback)
    try:
        entries: list[tuple[str, str, str]] = [
            ("node-a", other.endpoint, other.local_endpoint or ""),
            ("node-z", "tcp://127.0.0.1:9", f"unix:{tmp_path / 'gone.sock'}")]
        probed = _probes(monkeypatch)

        def starter() -> object:
            agent = host_agent(pool, lambda: None, KEY, "node-b", loopback)
            entries.insert(1, ("node-b", agent.endpoint, agent.local_endpoint or ""))
            return agent

        starting = Starting(_Leaders("node-b", 8, entries), KEY, 5.0, starter)  # type: ignore[arg-type]
        hosted = starting.finish()
        try:
            assert hosted.agent is not None and len(probed) == 2
            ring = [other.endpoint, hosted.agent.endpoint]
            assert hosted.nodes == ring and hosted.agent.nodes == ring
            assert len(probed) == 2
        finally:
            hosted.close()
    finally:
        other.stop()
