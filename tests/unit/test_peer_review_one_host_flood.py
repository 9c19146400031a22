"""One host of the network that opens connections to an agent's TCP listener and sends
nothing holds at most three quarters of the listener's connections: the rest stay
open to the job's other nodes, whose signed requests are still served, where before
that one host could have every other node's connection closed at once (each node then
took the agent for a busy one and asked the origin). The warning names the address."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.peer import Agent, _client, _servers, derive_key
from distcache.store import ArtifactPool

KEY = derive_key(b"h" * 32)
FLOODER = "127.0.0.2"  # another loopback address: another host, as the agent sees it


def _wait_open(listener: object, count: int) -> int:
    """The listener's open connections once ``count`` are, or after 10 s."""
    deadline = time.monotonic() + 10
    while getattr(listener, "_open", 0) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # and any more it would admit
    return int(getattr(listener, "_open", 0))


def test_one_host_holding_idle_connections_leaves_room_for_the_other_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(_servers, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(_servers, "PER_NODE", 1)
    caplog.set_level(logging.WARNING, logger="distcache")
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"held")
    held = Artifact("held.cubin", sha256_hex(b"held"))
    agent = Agent(pool, lambda: None, KEY).start()
    agent.join([agent.endpoint], 0)
    host, port = agent.endpoint.removeprefix("tcp://").rsplit(":", 1)
    listener = agent._servers[0]  # the TCP one
    idle: list[socket.socket] = []
    try:
        for _ in range(8):  # as many as the whole cap, from one address
            idle.append(socket.create_connection((host, int(port)), 2,
                                                 source_address=(FLOODER, 0)))
        opened = _wait_open(listener, 6)
        got = _client.fetch(agent.endpoint, KEY, held, fill=False, timeout=5)
        assert got.data == b"held"  # another address is served meanwhile
        assert opened == 6  # three quarters of 8 from the one address
    finally:
        for conn in idle:
            conn.close()
        agent.stop()
    assert agent.counts["served"] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(FLOODER in said for said in warned), warned


def test_the_other_nodes_still_fill_the_whole_cap_together(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The share is per address: connections from several addresses may hold every
    connection the listener has, and one more is closed at once, as before."""
    monkeypatch.setattr(_servers, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(_servers, "PER_NODE", 1)
    agent = Agent(ArtifactPool(tmp_path / "pool"), lambda: None, KEY).start()
    agent.join([agent.endpoint], 0)
    host, port = agent.endpoint.removeprefix("tcp://").rsplit(":", 1)
    listener = agent._servers[0]
    idle: list[socket.socket] = []
    try:
        for source in ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"):
            idle.append(socket.create_connection((host, int(port)), 2,
                                                 source_address=(source, 0)))
        assert _wait_open(listener, 4) == 4
        with socket.create_connection((host, int(port)), 2,
                                      source_address=("127.0.0.4", 0)) as fifth:
            fifth.settimeout(5)
            assert fifth.recv(1) == b""  # closed at once
    finally:
        for conn in idle:
            conn.close()
        agent.stop()
    assert getattr(listener, "turned_away", None) == 1
