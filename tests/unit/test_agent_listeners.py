"""The node agent's listeners over their lifetime: a start that fails half-way closes
the TCP listener it had opened; a stop removes its Unix socket's name only while that
is still its own socket; the TCP listener never looks its address's name up."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from distcache.peer import Agent
from distcache.store import ArtifactPool

KEY = b"k" * 32


def _agent(tmp_path: Path, socket_path: Path | None) -> Agent:
    return Agent(ArtifactPool(tmp_path / "pool"), lambda: None, KEY, socket_path=socket_path)


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_failed_socket_closes_the_tcp_listener(tmp_path: Path) -> None:
    # The Unix socket cannot be made (its directory does not exist): the TCP listener
    # opened before it is closed, not left listening with nobody serving it.
    agent = _agent(tmp_path, tmp_path / "missing" / "agent.sock")
    with pytest.raises(OSError):
        agent.start()
    assert agent.endpoint.startswith("tcp://127.0.0.1:")
    assert not _accepts(_port(agent.endpoint))
    agent.stop()  # nothing left to stop: returns at once, does not wait on a server


def test_stop_leaves_a_socket_put_there_since(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    agent = _agent(tmp_path, path).start()
    assert path.is_socket()
    # Another agent on the same pool (a later start) puts its own socket at the name.
    later = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fresh = tmp_path / ".later"
        later.bind(str(fresh))
        later.listen(1)
        os.replace(fresh, path)
        theirs = os.lstat(path)
        agent.stop()
        assert path.is_socket()
        assert (os.lstat(path).st_dev, os.lstat(path).st_ino) == (theirs.st_dev,
                                                                   theirs.st_ino)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with probe:
            probe.connect(str(path))  # still the later agent's, reachable
    finally:
        later.close()


def test_stop_removes_its_own_socket(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    agent = _agent(tmp_path, path).start()
    tcp = _port(agent.endpoint)
    assert path.is_socket() and _accepts(tcp)
    agent.stop()
    assert not path.exists()
    assert not _accepts(tcp)


def test_tcp_listener_does_not_resolve_its_address(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def getfqdn(name: str = "") -> str:
        asked.append(name)
        return name

    monkeypatch.setattr(socket, "getfqdn", getfqdn)
    agent = _agent(tmp_path, None).start()
    try:
        assert asked == []
        assert _accepts(_port(agent.endpoint))
    finally:
        agent.stop()
