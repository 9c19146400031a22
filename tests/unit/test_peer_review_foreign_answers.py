"""Answers no agent of the job sends: a redirect, a status an agent never answers, a
404 or 503 without the agent's signature (an agent signs every answer to a request it
authenticated; only its 403, to a request it could not, is bare). Whatever listens at
an owner's endpoint and answers so is not an agent of this job: the walk leaves it out
for a while, as for an unsigned final answer, and names it once at WARNING, rather than
asking it again on every walk and saying so only at DEBUG."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.errors import PeerError
from distcache.peer import _agent, _client, derive_key
from distcache.testing import make_artifacts
from tests.unit.test_peer_day_one_unsigned_bodies import impostor, walk_past

KEY = derive_key(b"r" * 32)

#: (status, reason header or None, extra headers) of answers no agent of the job sends.
FOREIGN: dict[str, tuple[int, str | None, tuple[str, ...]]] = {
    "redirect": (302, None, (f"Location: http://127.0.0.1:9/v1/objects/{'0' * 64}",)),
    "server error": (500, None, ()),
    "unsigned not-held": (404, "not-held", ()),
    "unsigned busy": (503, "busy", ()),
}


def _foreign(kind: str) -> contextlib.AbstractContextManager[Any]:
    """An endpoint answering every request as :data:`FOREIGN` says, with no body."""
    status, reason, headers = FOREIGN[kind]
    return impostor(status, reason, headers=headers, body=b"")


@pytest.fixture
def made(tmp_path: Path) -> list[Artifact]:
    return make_artifacts(tmp_path / "repo", 16, min_size=500, max_size=1500, seed=11)


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_an_answer_no_agent_sends_is_taken_for_an_endpoint_to_leave_out(
        kind: str, made: list[Artifact]) -> None:
    with _foreign(kind) as fake, pytest.raises(PeerError) as raised:
        _client.fetch(fake.endpoint, KEY, made[0], fill=True, timeout=5)
    assert isinstance(raised.value, _client.Unsigned)
    assert _client.gone(raised.value, whole=True)
    assert "not an agent of this job" in str(raised.value)


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_an_owner_endpoint_answering_what_no_agent_sends_is_left_out_and_named(
        kind: str, tmp_path: Path, made: list[Artifact], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(_agent, "DOWN_S", 3600.0)  # left out for the whole test
    caplog.set_level(logging.WARNING, logger="distcache")
    with _foreign(kind) as fake:
        _, asked = walk_past(tmp_path, made, fake.endpoint)
    assert asked == 3  # this node, the next in each order, for each of the three
    assert fake.asked == 1  # then left out
    named = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and fake.endpoint in r.getMessage()]
    assert len(named) == 1, named
