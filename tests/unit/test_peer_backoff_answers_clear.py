"""A node left out for saying nothing is asked again when its back-off ends, and any
answer it then gives (the bytes, a signed "not at the origin", "still downloading",
a busy or refusing answer) ends its back-off for every asker: the next failure starts
again from the first wait, not a doubled one."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.errors import ArtifactNotFound, PeerError
from distcache.peer import _agent, _backoff, _client
from distcache.peer import _tier as peer_tier
from distcache.peer._backoff import Backoff
from distcache.store import ArtifactPool
from tests.unit.test_peer_agent import KEY

OWNER = "tcp://127.0.0.1:9"
ART = Artifact("k.cubin", "a" * 64)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(_backoff, "_now", fake)
    return fake


def _answers(monkeypatch: pytest.MonkeyPatch, *outcomes: BaseException | None) -> list[str]:
    """Make the owner answer ``outcomes`` in turn (None: the bytes)."""
    asked: list[str] = []
    left = list(outcomes)

    def fetch(endpoint: str, *args: Any, **kwargs: Any) -> _client.Answer:
        asked.append(endpoint)
        outcome = left.pop(0)
        if outcome is None:
            return _client.Answer(b"bytes", "peer")
        raise outcome

    monkeypatch.setattr(_client, "fetch", fetch)
    monkeypatch.setattr(_client, "pause_after", lambda asked: None)
    return asked


@pytest.fixture
def agent(tmp_path: Path) -> _agent.Agent:
    return _agent.Agent(ArtifactPool(tmp_path / "pool"), lambda: None, KEY)


def _walk(agent: _agent.Agent) -> Any:
    return agent._from(OWNER, ART, time.monotonic() + 30)


def _silent() -> PeerError:
    return _client.Silent("said nothing", sha256=ART.sha256, status=0, refused=False)


@pytest.mark.parametrize("answer", [
    pytest.param(None, id="the bytes"),
    pytest.param(ArtifactNotFound("not at the origin", name=ART.name), id="not at origin"),
    pytest.param(PeerError("busy", sha256=ART.sha256, status=503, refused=False), id="busy"),
    pytest.param(PeerError("refused", sha256=ART.sha256, status=403, refused=True),
                 id="refused"),
])
def test_any_answer_after_a_back_off_ends_it(monkeypatch: pytest.MonkeyPatch, clock: _Clock,
                                             agent: _agent.Agent, answer: Any) -> None:
    asked = _answers(monkeypatch, _silent(), answer, _silent())
    assert _walk(agent) is None and agent._down.down(OWNER)  # left out: 10 s
    clock.now += _agent.DOWN_S + 0.1
    with contextlib.suppress(ArtifactNotFound):
        _walk(agent)  # asked again: it answers
    assert not agent._down.down(OWNER)
    assert len(asked) == 2
    assert _walk(agent) is None  # silent again: the first wait, not a doubled one
    clock.now += _agent.DOWN_S + 0.1
    assert not agent._down.down(OWNER)


def test_an_owner_still_downloading_answers(monkeypatch: pytest.MonkeyPatch, clock: _Clock,
                                            agent: _agent.Agent) -> None:
    filling = _client.Filling("still downloading", sha256=ART.sha256, status=503,
                              refused=False)
    asked = _answers(monkeypatch, _silent(), filling, None)
    assert _walk(agent) is None
    clock.now += _agent.DOWN_S + 0.1
    got = _walk(agent)  # told it downloads, asked again, then served
    assert got is not None and got.data == b"bytes"
    assert len(asked) == 3 and not agent._down.down(OWNER)


def test_a_lookup_without_a_verdict_lets_the_others_ask_again(clock: _Clock) -> None:
    down = Backoff()
    down.failed("e", 10, 300)
    clock.now += 10.1
    assert not down.skip("e", 30)  # this asker asks; the others wait for it
    assert down.skip("e", 30)
    down.release("e")  # it ended without a verdict
    assert not down.skip("e", 30)
    down.release("never-failed")  # nothing to release: no effect
    assert not down.skip("never-failed", 30)


def test_a_tier_lookup_ending_without_a_status_releases_the_agent(
        monkeypatch: pytest.MonkeyPatch, clock: _Clock) -> None:
    monkeypatch.setattr(peer_tier, "_down", Backoff())
    tier = peer_tier.Tier("unix:/nonexistent", KEY, bound=5)
    peer_tier._down.failed(tier.endpoint, 10, 300)
    clock.now += 10.1
    assert not peer_tier._down.skip(tier.endpoint, tier.bound)
    undecided = PeerError("cut short", sha256=ART.sha256, status=0, refused=False)
    monkeypatch.setattr(_client, "gone", lambda exc, whole: False)
    peer_tier._failed(tier, ART, undecided)
    assert not peer_tier._down.skip(tier.endpoint, tier.bound)
