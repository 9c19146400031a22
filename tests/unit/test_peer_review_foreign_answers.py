"""Answers no agent of the job sends: a redirect, a status an agent never answers, a
404 or 503 without the agent's signature (an agent signs every answer to a request it
authenticated; only its 403, to a request it could not, is bare). Whatever listens at
an owner's endpoint and answers so is not an agent of this job: the walk leaves it out
for a while, as for an unsigned final answer, and names it once at WARNING, rather than
asking it again on every walk and saying so only at DEBUG."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import PeerError
from distcache.origins import HttpOrigin
from distcache.peer import Tier, _agent, _client, derive_key, host_agent, lookup, order
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.origins import read_head

KEY = derive_key(b"r" * 32)

#: (status line, extra headers) of answers no agent of the job sends.
FOREIGN = {
    "redirect": ("302 Found", [f"Location: http://127.0.0.1:9/v1/objects/{'0' * 64}"]),
    "server error": ("500 Internal Server Error", []),
    "unsigned not-held": ("404 Not Found", [f"{_client.HEADER_REASON}: not-held"]),
    "unsigned busy": ("503 Service Unavailable", [f"{_client.HEADER_REASON}: busy"]),
}


class _Foreign:
    """A TCP endpoint that answers every request with ``status`` and ``headers`` and
    no body; counts the requests."""

    def __init__(self, status: str, headers: list[str]) -> None:
        self.status, self.headers, self.asked = status, headers, 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                if read_head(conn) is None:
                    continue
                self.asked += 1
                lines = [f"HTTP/1.1 {self.status}", *self.headers, "Content-Length: 0",
                         "Connection: close"]
                conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())

    def close(self) -> None:
        self._server.close()


@contextlib.contextmanager
def _foreign(kind: str) -> Iterator[_Foreign]:
    served = _Foreign(*FOREIGN[kind])
    try:
        yield served
    finally:
        served.close()


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
    with LoopbackOrigin(tmp_path / "repo") as origin, _foreign(kind) as fake:
        agent = host_agent(ArtifactPool(tmp_path / "pool"), lambda: HttpOrigin(origin.url),
                           KEY, "a")
        try:
            nodes = [agent.endpoint, fake.endpoint]
            agent.join(nodes, 0)
            owned = [a for a in made if order(a.sha256, nodes)[0] == 1][:3]
            assert len(owned) == 3
            tier = Tier(agent.local_endpoint or "", KEY, bound=10)
            got = [lookup(a, tier) for a in owned]
        finally:
            agent.stop()
    assert all(g is not None and sha256_hex(g.data) == a.sha256
               for g, a in zip(got, owned, strict=True))
    assert origin.total_requests == len(owned)  # this node, the next in each order
    assert fake.asked == 1  # then left out
    named = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and fake.endpoint in r.getMessage()]
    assert len(named) == 1, named
