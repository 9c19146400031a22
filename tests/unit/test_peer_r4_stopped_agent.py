"""A node agent that is stopped (its process alive, its listening socket taking
connections into the kernel's backlog, nothing answering) costs one lookup or one
walk its whole bound, not every one after it: it is left out for a back-off that
doubles while it stays silent, up to a cap, said once at WARNING, and ends at its
first answer. A socket bound and listening that never accepts is such an agent."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.peer import Tier, host_agent, lookup, order
from distcache.peer import _tier as peer_tier
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.unit.test_peer_agent import KEY
from tests.unit.test_peer_owner_down_and_key import _asker_beside

#: A short bound, so that each ask of the silent agent costs the test about a second.
BOUND_S = 1.0


class _Clock:
    """What the back-off reads as the time: moved by the test, never by waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def _silent(family: int, address: str | tuple[str, int]
            ) -> Iterator[tuple[Callable[[], int], Any]]:
    """A socket bound and listening at ``address`` that never accepts (a stopped
    agent); yields what counts the connections asked of it so far, and its address."""
    server = socket.socket(family, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(64)
    server.setblocking(False)
    taken = 0

    def asked() -> int:
        nonlocal taken
        while True:
            try:
                conn, _ = server.accept()
            except BlockingIOError:
                return taken
            conn.close()
            taken += 1

    try:
        yield asked, server.getsockname()
    finally:
        server.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    from distcache.peer import _backoff

    fake = _Clock()
    monkeypatch.setattr(_backoff, "_now", fake)
    return fake


@pytest.mark.timeout(60)
def test_a_lookup_skips_a_node_agent_that_said_nothing_in_its_whole_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="distcache.peer")
    path = tmp_path / "stopped.sock"
    artifact = Artifact("k.cubin", "ab" * 32)
    with _silent(socket.AF_UNIX, str(path)) as (asked, _):
        tier = Tier(f"unix:{path}", KEY, bound=BOUND_S)
        left_out = peer_tier.counts["left_out"]
        got = [lookup(artifact, tier) for _ in range(5)]
        assert got == [None] * 5  # the loader goes to the origin each time
        assert asked() == 1  # asked once; the next four went to the origin at once
    assert peer_tier.counts["left_out"] == left_out + 4
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and str(path) in r.getMessage()]
    assert len(warned) == 1, warned  # said once, not per lookup
    assert "said nothing" in warned[0] and "origin" in warned[0]


@pytest.mark.timeout(60)
def test_a_silent_node_agent_is_asked_again_after_a_back_off_that_doubles(
    tmp_path: Path, clock: _Clock,
) -> None:
    from distcache.peer import _tier

    path = tmp_path / "stopped.sock"
    artifact = Artifact("k.cubin", "cd" * 32)
    first = _tier.LEFT_OUT_S
    with _silent(socket.AF_UNIX, str(path)) as (asked, _):
        tier = Tier(f"unix:{path}", KEY, bound=BOUND_S)
        assert lookup(artifact, tier) is None and asked() == 1
        clock.now += first / 2
        assert lookup(artifact, tier) is None and asked() == 1  # left out
        clock.now += first  # past the first back-off: asked again, silent again
        assert lookup(artifact, tier) is None and asked() == 2
        clock.now += first + 0.1  # the back-off doubled: still left out
        assert lookup(artifact, tier) is None and asked() == 2
        clock.now += first  # past the doubled one
        assert lookup(artifact, tier) is None and asked() == 3
        clock.now += 10 * _tier.LEFT_OUT_MAX_S  # the cap bounds it, however long silent
        assert lookup(artifact, tier) is None and asked() == 4
        clock.now += _tier.LEFT_OUT_MAX_S + 0.1
        assert lookup(artifact, tier) is None and asked() == 5


@pytest.mark.timeout(120)
def test_a_node_agent_that_answers_again_is_asked_from_then_on(
    tmp_path: Path, clock: _Clock, caplog: pytest.LogCaptureFixture,
) -> None:
    from distcache.peer import _tier

    made = make_artifacts(tmp_path / "repo", 2, min_size=500, max_size=1_000)
    caplog.set_level(logging.INFO, logger="distcache.peer")
    with LoopbackOrigin(tmp_path / "repo") as origin:
        pool = ArtifactPool(tmp_path / "pool")
        from distcache.origins import HttpOrigin
        from distcache.peer._hosting import socket_path

        path = socket_path(Path(pool.root), "node0")
        with _silent(socket.AF_UNIX, str(path)) as (asked, _):
            tier = Tier(f"unix:{path}", KEY, bound=BOUND_S)
            assert lookup(made[0], tier) is None and asked() == 1
        # The agent is back at the same socket (it was stopped, then continued).
        agent = host_agent(pool, lambda: HttpOrigin(origin.url), KEY, "node0")
        try:
            agent.join([agent.endpoint], 0)
            assert lookup(made[1], tier) is None  # still within the back-off
            clock.now += _tier.LEFT_OUT_S + 0.1
            got = [lookup(a, tier) for a in made]
        finally:
            agent.stop()
    assert [g and g.source for g in got] == ["origin", "origin"]
    said = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert any("answers again" in m for m in said), said


@pytest.fixture
def short_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.peer import _agent

    monkeypatch.setattr(_agent, "HOP_S", BOUND_S)


@pytest.mark.timeout(120)
def test_a_walk_leaves_a_stopped_owner_out_for_a_back_off_that_doubles_said_once(
    tmp_path: Path, clock: _Clock, short_hop: None, caplog: pytest.LogCaptureFixture,
) -> None:
    from distcache.peer import _agent

    made = make_artifacts(tmp_path / "repo", 40, min_size=500, max_size=1_000)
    caplog.set_level(logging.DEBUG, logger="distcache.peer")
    with LoopbackOrigin(tmp_path / "repo") as origin, \
            _silent(socket.AF_INET, ("127.0.0.1", 0)) as (asked, where):
        # The silent owner's endpoint: the listening socket's own port.
        silent = f"tcp://127.0.0.1:{where[1]}"
        with _asker_beside(silent, tmp_path, origin.url) as agent:
            ring = [silent, agent.endpoint]
            owned = iter([a for a in made if order(a.sha256, ring)[0] == 0])
            tier = Tier(agent.local_endpoint or "", KEY, bound=10)

            def walk() -> str | None:
                got = lookup(next(owned), tier)
                return got and got.source

            assert walk() == "fallback" and asked() == 1  # a whole hop, then the origin
            assert walk() == "fallback" and asked() == 1  # left out
            clock.now += _agent.DOWN_S + 0.1
            assert walk() == "fallback" and asked() == 2  # asked again: silent again
            clock.now += _agent.DOWN_S + 0.1
            assert walk() == "fallback" and asked() == 2  # the back-off doubled
            clock.now += _agent.DOWN_S
            assert walk() == "fallback" and asked() == 3
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and silent in r.getMessage()]
    assert len(warned) == 1, warned
    assert "said nothing" in warned[0]
