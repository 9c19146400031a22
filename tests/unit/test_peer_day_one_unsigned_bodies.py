"""An answer's body is read only once the agent signed the answer for the very request,
whatever its status: a process at an agent's endpoint that answers a refusal with a long
body (an agent's refusals have none) costs the asker no memory, and the walk leaves that
endpoint out for a while, as for an unsigned answer with the bytes."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import PeerError
from distcache.origins import HttpOrigin
from distcache.peer import Tier, _agent, _client, derive_key, host_agent, lookup, order
from distcache.peer._auth import HEADER_ANSWER, sign_answer
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.origins import read_head

KEY = derive_key(b"s" * 32)
OTHER_KEY = derive_key(b"o" * 32)
#: What the impostor announces and sends: far more than any refusal of an agent's.
BODY = 256 * 1024


class _Impostor:
    """A TCP endpoint that answers every request with ``head`` (its status line and
    headers, the request's signature headers at hand, and ``headers``) then ``body``;
    counts requests. ``reason`` None: no reason header."""

    def __init__(self, status: int, reason: str | None, *, length: bool = True,
                 key: bytes | None = None, body: bytes = b"\0" * BODY,
                 headers: tuple[str, ...] = ()) -> None:
        self.status, self.reason, self.length, self.key, self.body = (
            status, reason, length, key, body)
        self.headers = headers
        self.asked = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            head = read_head(conn)
            if head is None:
                return
            self.asked += 1
            request = dict(line.split(": ", 1) for line in
                           head.decode("latin-1").split("\r\n")[1:] if ": " in line)
            lines = [f"HTTP/1.1 {self.status} X", *self.headers, "Connection: close"]
            if self.reason is not None:
                lines.append(f"{_client.HEADER_REASON}: {self.reason}")
            if self.length:
                lines.append(f"Content-Length: {len(self.body)}")
            if self.key is not None:
                lines.append(f"{HEADER_ANSWER}: "
                             f"{sign_answer(self.key, request, self.status, self.reason or '')}")
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + self.body)

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def made(tmp_path: Path) -> list[Artifact]:
    """Artifacts asked for by name and sha256 alone, as FlashInfer's loader asks: an
    answer's body is bounded only by ``DISTCACHE_MAX_ARTIFACT_BYTES``."""
    return [Artifact(a.name, a.sha256) for a in
            make_artifacts(tmp_path / "repo", 16, min_size=500, max_size=1500, seed=5)]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per answer body the client starts to read."""
    seen: list[int] = []
    body = _client._body

    def counted(*args: Any) -> bytes:
        seen.append(1)
        return body(*args)

    monkeypatch.setattr(_client, "_body", counted)
    return seen


@contextlib.contextmanager
def impostor(status: int, reason: str | None, **kwargs: object) -> Iterator[_Impostor]:
    served = _Impostor(status, reason, **kwargs)  # type: ignore[arg-type]
    try:
        yield served
    finally:
        served.close()


@pytest.mark.parametrize(("status", "reason", "length"), [
    (404, "not-held", True), (503, "busy", True), (403, "unauthenticated", True),
    (404, _client.NOT_AT_ORIGIN, True), (503, "unavailable", False),
], ids=["404", "503", "403", "not-at-origin", "503-until-close"])
@pytest.mark.parametrize("key", [None, OTHER_KEY], ids=["unsigned", "another-key"])
def test_a_refusal_with_a_body_and_no_signature_is_skipped_before_the_body_is_read(
    made: list[Artifact], reads: list[int], status: int, reason: str, length: bool,
    key: bytes | None,
) -> None:
    with (impostor(status, reason, length=length, key=key) as fake,
          pytest.raises(_client.Unsigned) as raised):
        _client.fetch(fake.endpoint, KEY, made[0], fill=True, timeout=5)
    assert reads == []
    assert "its body was not read" in str(raised.value)
    assert _client.gone(raised.value, whole=True)  # left out of walks a while


def test_an_agents_own_refusals_are_read_as_before(made: list[Artifact],
                                                   reads: list[int]) -> None:
    """A signed refusal, and an unsigned one with no body (an agent's answer to a
    request it cannot authenticate), are refusals, not an impostor's answers."""
    with (impostor(503, "busy", key=KEY, body=b"") as fake,
          pytest.raises(PeerError) as signed):
        _client.fetch(fake.endpoint, KEY, made[0], fill=True, timeout=5)
    with (impostor(403, "unauthenticated", body=b"") as fake,
          pytest.raises(PeerError) as unsigned):
        _client.fetch(fake.endpoint, KEY, made[0], fill=True, timeout=5)
    assert not isinstance(signed.value, _client.Unanswered)
    assert not isinstance(unsigned.value, _client.Unanswered)
    assert (signed.value.status, unsigned.value.status) == (503, 403)  # type: ignore[attr-defined]
    assert unsigned.value.refused  # type: ignore[attr-defined]
    assert len(reads) == 2


def test_a_real_agent_with_another_key_refuses_without_being_taken_for_animpostor(
    tmp_path: Path, made: list[Artifact],
) -> None:
    agent = host_agent(ArtifactPool(tmp_path / "pool-other"), lambda: None, OTHER_KEY, "o")
    try:
        with pytest.raises(PeerError) as raised:
            _client.fetch(agent.endpoint, KEY, made[0], fill=True, timeout=5)
    finally:
        agent.stop()
    assert not isinstance(raised.value, _client.Unanswered)
    assert raised.value.status == 403  # type: ignore[attr-defined]


def walk_past(tmp_path: Path, made: list[Artifact], endpoint: str) -> tuple[Any, int]:
    """Three lookups through an agent of this job whose ring's other node is at
    ``endpoint`` (which owns each of the three): each served and verified; the agent
    and the number of requests its origin saw."""
    with LoopbackOrigin(tmp_path / "repo") as origin:
        agent = host_agent(ArtifactPool(tmp_path / "pool-a"), lambda: HttpOrigin(origin.url),
                           KEY, "a")
        try:
            nodes = [agent.endpoint, endpoint]
            agent.join(nodes, 0)
            owned = [a for a in made if order(a.sha256, nodes)[0] == 1][:3]
            assert len(owned) == 3
            tier = Tier(agent.local_endpoint or "", KEY, bound=10)
            got = [lookup(a, tier) for a in owned]
        finally:
            agent.stop()
    assert all(g is not None and sha256_hex(g.data) == a.sha256
               for g, a in zip(got, owned, strict=True))
    return agent, origin.total_requests


def test_an_owner_endpoint_that_answers_refusals_with_bodies_is_left_out_of_later_walks(
    tmp_path: Path, made: list[Artifact], reads: list[int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_agent, "DOWN_S", 3600.0)  # left out for the whole test
    with impostor(404, "not-held") as fake:
        agent, asked = walk_past(tmp_path, made, fake.endpoint)
    # This node asked the origin for each; the impostor once, its body never read.
    owned = 3
    assert asked == owned
    assert fake.asked == 1
    assert agent.counts["fallback"] == owned
    assert len(reads) == owned  # the local answers' bodies alone
