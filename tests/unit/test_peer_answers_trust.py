"""What an asker trusts in a node agent's answers, how long a connection may be held,
and which endpoints a node dials: a final answer must be signed by the agent, every
answer closes its connection, a stopped agent serves no connection it had open, and
another host's loopback endpoint is left out with a warning."""

from __future__ import annotations

import contextlib
import http.server
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ArtifactNotFound, PeerError
from distcache.origins import HttpOrigin
from distcache.peer import (
    Agent,
    Tier,
    _client,
    _servers,
    derive_key,
    host_agent,
    lookup,
    order,
    sign,
)
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts

KEY = derive_key(b"s" * 32)
OTHER_KEY = derive_key(b"o" * 32)


@pytest.fixture
def made(tmp_path: Path) -> list[Artifact]:
    return make_artifacts(tmp_path / "repo", 12, min_size=500, max_size=1500, seed=3)


@pytest.fixture
def origin(tmp_path: Path, made: list[Artifact]) -> Iterator[LoopbackOrigin]:
    with LoopbackOrigin(tmp_path / "repo") as served:
        yield served


def _impostor(key: bytes | None, *, status: int = 404, said: str = _client.NOT_AT_ORIGIN,
              data: bytes = b"", signed_as: str | None = None,
              ) -> tuple[str, http.server.ThreadingHTTPServer]:
    """An endpoint that answers every request ``status`` with ``said`` (its reason, or
    for a 200 with ``data`` its source), signed with ``key`` as an agent signs
    (``None``: unsigned; ``signed_as``: what is signed, when it is not what is said)."""

    class Impostor(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header(_client.HEADER_SOURCE if status == 200 else _client.HEADER_REASON,
                             said)
            if key is not None:
                from distcache.peer._auth import HEADER_ANSWER, sign_answer

                request = {k: v for k, v in self.headers.items()}
                self.send_header(HEADER_ANSWER, sign_answer(
                    key, request, status, said if signed_as is None else signed_as))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"tcp://127.0.0.1:{server.server_address[1]}", server


def _agent(tmp_path: Path, url: str, name: str) -> Agent:
    return host_agent(ArtifactPool(tmp_path / f"pool-{name}"), lambda: HttpOrigin(url), KEY,
                      name)


# --- 1. a final answer is the agent's, signed ------------------------------------


def test_an_unsigned_not_at_origin_from_an_owners_endpoint_is_skipped_not_final(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    fake, server = _impostor(None)
    agent = _agent(tmp_path, origin.url, "a")
    try:
        nodes = [agent.endpoint, fake]
        agent.join(nodes, 0)
        owned = [a for a in made if order(a.sha256, nodes)[0] == 1][:2]
        assert owned
        got = [lookup(a, Tier(agent.local_endpoint or "", KEY, bound=10)) for a in owned]
    finally:
        agent.stop()
        server.shutdown()
        server.server_close()
    # The next node in the order (this one) asked the origin: once per artifact.
    assert all(g is not None and g.source == "fallback" and sha256_hex(g.data) == a.sha256
               for g, a in zip(got, owned, strict=True))
    assert origin.total_requests == len(owned)
    assert agent.counts["fallback"] == len(owned) and agent.counts["not_at_origin"] == 0
    said = [r.getMessage() for r in caplog.records]
    assert sum("without this job's signature" in m for m in said) == 1  # once per endpoint


@pytest.mark.parametrize("key", [None, OTHER_KEY], ids=["unsigned", "another-key"])
def test_a_not_at_origin_without_the_agents_signature_is_a_skip_for_the_client(
    made: list[Artifact], key: bytes | None,
) -> None:
    fake, server = _impostor(key)
    try:
        with pytest.raises(PeerError) as raised:
            _client.fetch(fake, KEY, made[0], fill=True, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert not isinstance(raised.value, ArtifactNotFound)
    assert _client.gone(raised.value, whole=True)  # left out of walks, as a broken answer


def test_a_signature_for_another_request_is_not_taken(made: list[Artifact]) -> None:
    """A signed answer seen on the way, replayed to a later request: not final."""
    from distcache.peer._auth import HEADER_ANSWER, answer_signed, sign_answer

    first = sign(KEY, "GET", "/v1/objects/ab", target="unix")
    later = sign(KEY, "GET", "/v1/objects/ab", target="unix")
    mac = sign_answer(KEY, first, 404, _client.NOT_AT_ORIGIN)
    assert answer_signed(KEY, first, 404, _client.NOT_AT_ORIGIN, mac)
    assert not answer_signed(KEY, later, 404, _client.NOT_AT_ORIGIN, mac)
    assert not answer_signed(KEY, first, 404, "not-held", mac)
    assert not answer_signed(OTHER_KEY, first, 404, _client.NOT_AT_ORIGIN, mac)
    assert not answer_signed(KEY, first, 404, _client.NOT_AT_ORIGIN, None)
    assert HEADER_ANSWER.startswith("X-Distcache-")


def test_a_genuine_not_at_origin_stays_final_and_one_node_asks_the_origin(
    tmp_path: Path, origin: LoopbackOrigin,
) -> None:
    agents = [_agent(tmp_path, origin.url, name) for name in ("a", "b")]
    nodes = [a.endpoint for a in agents]
    for i, agent in enumerate(agents):
        agent.join(nodes, i)
    # An artifact the origin lacks, owned by b, looked up from a.
    missing = next(Artifact(f"cubins/none{i}.cubin", sha256_hex(b"none%d" % i))
                   for i in range(64) if order(sha256_hex(b"none%d" % i), nodes)[0] == 1)
    try:
        with pytest.raises(ArtifactNotFound):
            lookup(missing, Tier(agents[0].local_endpoint or "", KEY, bound=10))
    finally:
        for agent in agents:
            agent.stop()
    assert origin.total_requests == 1  # the owner's, and no fallback by a
    assert agents[1].counts["origin"] == 0 and agents[1].counts["not_at_origin"] == 1
    assert agents[0].counts["fallback"] == 0 and agents[0].counts["not_at_origin"] == 1


# --- 2. no connection outlives its answer, nor the agent ----------------------------


def _connect(agent: Agent) -> socket.socket:
    host, port = agent.endpoint.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _read_all(sock: socket.socket) -> bytes:
    """What comes until the agent closes (a read that times out fails the test)."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_a_refused_request_closes_its_connection(tmp_path: Path, made: list[Artifact]) -> None:
    agent = Agent(ArtifactPool(tmp_path / "pool"), lambda: None, KEY).start()
    try:
        with _connect(agent) as sock:
            sock.sendall(f"GET /v1/objects/{made[0].sha256} HTTP/1.1\r\nHost: x\r\n\r\n"
                         .encode())
            answer = _read_all(sock)  # the connection ends with the refusal
    finally:
        agent.stop()
    assert answer.startswith(b"HTTP/1.1 403") and b"\r\nConnection: close\r\n" in answer
    assert agent.counts["refused_auth"] == 1


def test_clients_without_the_key_do_not_hold_the_connection_slots(
    tmp_path: Path, made: list[Artifact], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_servers, "MAX_CONNECTIONS", 2)
    pool = ArtifactPool(tmp_path / "pool")
    data = (tmp_path / "repo" / made[0].name).read_bytes()
    pool.put(data, made[0].sha256)
    agent = Agent(pool, lambda: None, KEY).start()
    holders = [_connect(agent) for _ in range(2)]
    try:
        for sock in holders:  # each as many unsigned requests as it likes, in turn
            sock.sendall(f"GET /v1/objects/{made[0].sha256} HTTP/1.1\r\nHost: x\r\n\r\n"
                         .encode())
            assert _read_all(sock).startswith(b"HTTP/1.1 403")
        got = _client.fetch(agent.endpoint, KEY, made[0], fill=False, timeout=5)
    finally:
        for sock in holders:
            sock.close()
        agent.stop()
    assert got.data == data
    assert agent._servers == [] and agent.counts["served"] == 1


def test_a_stopped_agent_answers_no_connection_it_had_open(
    tmp_path: Path, made: list[Artifact],
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put((tmp_path / "repo" / made[0].name).read_bytes(), made[0].sha256)
    agent = Agent(pool, lambda: None, KEY).start()
    path = f"/v1/objects/{made[0].sha256}"
    servers = list(agent._servers)
    with _connect(agent) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\n".encode())  # a request under way
        agent.stop()
        head = "".join(f"{k}: {v}\r\n" for k, v in
                       sign(KEY, "GET", path, target=agent.endpoint).items())
        with contextlib.suppress(OSError):  # the agent may have shut it already
            sock.sendall(f"Host: x\r\n{head}\r\n".encode())
        try:
            answer = _read_all(sock)
        except ConnectionResetError:
            answer = b""
    assert answer == b"" and agent.counts["served"] == 0
    assert all(not s._live for s in servers)  # type: ignore[attr-defined]


# --- 3. another host's loopback endpoint ------------------------------------------


class _Leaders:
    """The node leaders' all-gather, answered with ``entries`` (no collective)."""

    def __init__(self, node_id: str, entries: list[tuple[str, str, str]]) -> None:
        self.node_id, self.rank, self.size, self.entries = node_id, 0, len(entries), entries

    def allgather_object(self, obj: object, *, timeout: float | None = None) -> object:
        return self.entries


def _finish(node_id: str, entries: list[tuple[str, str, str]]) -> list[str]:
    from distcache.peer._hosting import Starting

    hosted = Starting(_Leaders(node_id, entries), KEY, 5.0, None).finish()  # type: ignore[arg-type]
    try:
        return hosted.nodes
    finally:
        hosted.close()


def test_another_hosts_loopback_endpoint_is_left_out_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    entries = [("node-a", "tcp://10.0.0.1:4000", "unix:/nonexistent/a.sock"),
               ("node-b", "tcp://127.0.1.1:4001", "unix:/nonexistent/b.sock"),
               ("node-c", "tcp://10.0.0.3:4002", "unix:/nonexistent/c.sock")]
    assert _finish("node-a", entries) == ["tcp://10.0.0.1:4000", "tcp://10.0.0.3:4002"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1
    assert "node node-b at tcp://127.0.1.1:4001" in said[0] and "MASTER_ADDR" in said[0]


def test_a_nodes_own_loopback_endpoint_is_kept_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    entries = [("node-a", "tcp://127.0.0.1:4000", "unix:/nonexistent/a.sock"),
               ("node-b", "tcp://10.0.0.2:4001", "unix:/nonexistent/b.sock")]
    assert _finish("node-a", entries) == [e[1] for e in entries]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 1 and "node node-a at tcp://127.0.0.1:4000" in said[0]


def test_nodes_simulated_on_one_host_keep_their_loopback_endpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    loopback = {"MASTER_ADDR": "127.0.0.1"}  # the agents bind 127.0.0.1
    agents = [host_agent(ArtifactPool(tmp_path / f"pool-{n}"), lambda: None, KEY, n, loopback)
              for n in ("node-a", "node-b")]
    try:
        entries = [(n, a.endpoint, a.local_endpoint or "")
                   for n, a in zip(("node-a", "node-b"), agents, strict=True)]
        assert all(e[1].startswith("tcp://127.0.0.1:") for e in entries)
        assert _finish("node-a", entries) == [a.endpoint for a in agents]
        # One node alone: its loopback endpoint is its own business.
        assert _finish("node-a", entries[:1]) == [agents[0].endpoint]
    finally:
        for agent in agents:
            agent.stop()
    assert not [r for r in caplog.records if "loopback" in r.getMessage()]


# --- the bytes too are read only from an answer the agent signed -------------------


@pytest.mark.parametrize(("key", "signed_source"),
                         [(None, None), (OTHER_KEY, None), (KEY, "origin")],
                         ids=["unsigned", "another-key", "another-source"])
def test_bytes_without_the_agents_signature_are_not_read(
    tmp_path: Path, made: list[Artifact], monkeypatch: pytest.MonkeyPatch,
    key: bytes | None, signed_source: str | None,
) -> None:
    """Even the artifact's own bytes: a process at an agent's endpoint without the key
    is skipped before its body is read, so one that announces gigabytes costs nothing."""
    data = (tmp_path / "repo" / made[0].name).read_bytes()
    assert sha256_hex(data) == made[0].sha256
    reads: list[int] = []
    body = _client._body
    monkeypatch.setattr(_client, "_body", lambda *a: reads.append(1) or body(*a))
    fake, server = _impostor(key, status=200, said="pool", data=data, signed_as=signed_source)
    try:
        with pytest.raises(_client.Unsigned) as raised:
            _client.fetch(fake, KEY, made[0], fill=False, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert reads == []
    assert "its body was not read" in str(raised.value)
    assert _client.gone(raised.value, whole=True)  # left out of walks a while


def test_bytes_the_agent_signed_are_taken(tmp_path: Path, made: list[Artifact]) -> None:
    data = (tmp_path / "repo" / made[0].name).read_bytes()
    fake, server = _impostor(KEY, status=200, said="peer", data=data)
    try:
        got = _client.fetch(fake, KEY, made[0], fill=False, timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert got.data == data and got.source == "peer"
