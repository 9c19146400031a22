"""``python -m launch --peers`` always tells PROGRAM what to do about peers: the node
agent's socket where the node has one, else ``DISTCACHE_PEERS=0``. Left as inherited
(``1``, the default), PROGRAM's ``init`` on a node whose agent could not start would
start agents of its own, collectives the other nodes' ranks never join. Run in-process:
the rendezvous and the agents are stand-ins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import launch.__main__ as wrapper
from distcache.config import settings
from distcache.peer import Hosted, Tier
from distcache.peer._hosting import start_for_session
from launch import detect
from tests.unit.test_launch_nesting import _openmpi

KEY = b"k" * 32


class _Comm:
    """A communicator of two ranks that no collective may be run on."""

    size, rank, node_id = 2, 0, "na"

    def __getattr__(self, name: str) -> Any:
        pytest.fail(f"a collective ({name}) was started")


def _two_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of ``mpirun -n 2``, one rank on each of two nodes, its rendezvous given."""
    info = detect({**_openmpi(0, 2, 0, 1), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
                  hostname="na")
    monkeypatch.setattr(wrapper, "detect", lambda: info)
    monkeypatch.setattr(wrapper, "mpi_publish", lambda *a: pytest.fail("no rendezvous asked"))
    # Logging is not under test; the real set-up would outlive the test.
    monkeypatch.setattr(wrapper, "configure_logging", lambda verbose, rank: lambda: None)


def _program_env(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                 host_peers: Any, inherited: str | None) -> dict[str, str]:
    """The environment PROGRAM gets from ``python -m launch ARGV`` on rank 0 of two, on
    two nodes, where the agents' start-up is ``host_peers`` and this process has
    ``DISTCACHE_PEERS=inherited`` (None: unset)."""
    if inherited is None:
        monkeypatch.delenv("DISTCACHE_PEERS", raising=False)
    else:
        monkeypatch.setenv("DISTCACHE_PEERS", inherited)
    _two_nodes(monkeypatch)
    monkeypatch.setattr(wrapper, "_host_peers", host_peers)
    seen: list[dict[str, str]] = []

    def program(command: list[str], env: dict[str, str], terminal: bool) -> int:
        seen.append(env)
        return 0

    monkeypatch.setattr(wrapper, "run", program)
    with pytest.raises(SystemExit) as exited:
        wrapper.main([*argv, "--", "true"])
    assert exited.value.code == 0
    assert len(seen) == 1
    return seen[0]


def _hosting(hosted: Hosted | None) -> Any:
    """``--peers``'s start-up of the node agents, giving this rank ``hosted``."""
    return lambda info, pool: hosted


@pytest.mark.parametrize("inherited", [None, "1"], ids=["unset", "one"])
@pytest.mark.parametrize("hosted", [Hosted(None), None], ids=["no-agent-here", "one-node"])
def test_a_node_without_an_agent_gets_peers_off_and_its_init_starts_no_collective(
    monkeypatch: pytest.MonkeyPatch, hosted: Hosted | None, inherited: str | None,
) -> None:
    env = _program_env(monkeypatch, ["--peers"], _hosting(hosted), inherited)
    assert env.get("DISTCACHE_PEERS") == "0"
    # What PROGRAM's init does with it: begins no agents (no node_tree, no all-gather).
    peers = settings(env).peers
    assert start_for_session(_Comm(), None, None, None, peers) is None  # type: ignore[arg-type]


def test_a_node_with_an_agent_gets_its_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    sock = tmp_path / ".peer-0.sock"
    env = _program_env(monkeypatch, ["--peers"], _hosting(Hosted(Tier(f"unix:{sock}", KEY))),
                       "1")
    assert env.get("DISTCACHE_PEERS") == str(sock)
    assert start_for_session(_Comm(), None, None, None,  # type: ignore[arg-type]
                             settings(env).peers) is None


def test_without_peers_the_inherited_setting_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = _program_env(monkeypatch, [], lambda info, pool: pytest.fail("hosted"), "1")
    assert env.get("DISTCACHE_PEERS") == "1"
