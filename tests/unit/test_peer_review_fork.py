"""A node agent's process that forks: the child holds none of the agent's listeners.

A child forked from the process hosting the agent (a data loader's workers, an engine
forking its workers) has none of the agent's threads. Were it to keep its copies of
the listening sockets, a stopped agent's port, or a killed one's socket, would still
take connections nobody accepts, and every asker would wait out its whole time; and a
child closing the session it inherited would wait for ever on a serving thread it
does not have, or remove the parent's socket and key. Each scenario runs in a fresh
interpreter, so that the fork happens in a process of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import PeerError
from distcache.peer import Tier, _client, derive_key, lookup

KEY = derive_key(b"f" * 32)
DATA = b"forked agent " * 64
SHA = sha256_hex(DATA)

#: Starts an agent on a pool holding DATA, then forks a child that lives until a byte
#: comes on a pipe (both ends stay open in it, so its parent's death does not end it),
#: or a minute at most; the rest of each scenario follows.
_PRELUDE = f"""
import json, os, select, sys, time
from pathlib import Path
from distcache.peer import Hosted, _client, derive_key, host_agent
from distcache.artifact import Artifact
from distcache.store import ArtifactPool

pool = ArtifactPool(Path(sys.argv[1]))
sha = {SHA!r}
pool.put({DATA!r}, sha)
key = derive_key(b"f" * 32)
agent = host_agent(pool, lambda: None, key, "n/fork")
hold_r, hold_w = os.pipe()
child = os.fork()
if child == 0:
    select.select([hold_r], [], [], 60.0)
    os._exit(0)
"""


def _run(tmp_path: Path, body: str, timeout: float = 60) -> dict[str, object]:
    """Run the prelude then ``body`` in a fresh interpreter; the JSON its last line
    prints."""
    done = subprocess.run([sys.executable, "-c", _PRELUDE + body, str(tmp_path / "pool")],
                          capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    got: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


def test_a_stopped_agents_port_refuses_at_once_though_its_process_forked(
        tmp_path: Path) -> None:
    """The agent stops while the child it forked lives: its port refuses an asker at
    once (a hop to an agent not there), not after the asker's whole time."""
    got = _run(tmp_path, """
Hosted(None, agent).close()
start = time.monotonic()
try:
    _client.fetch(agent.endpoint, key, Artifact("a", sha), fill=False, timeout=6)
    outcome = ["served", None]
except Exception as exc:
    outcome = [type(exc).__name__, getattr(exc, "status", "?")]
took = time.monotonic() - start
os.write(hold_w, b"x")
os.waitpid(child, 0)
print(json.dumps({"outcome": outcome, "took": took}))
""")
    assert got["outcome"] == ["PeerError", None]  # refused: nobody listens there
    assert float(got["took"]) < 3.0  # type: ignore[arg-type]


def test_a_killed_agents_socket_and_port_refuse_at_once_though_its_child_lives(
        tmp_path: Path) -> None:
    """The agent's process is killed outright (no hook removes its socket) while the
    child it forked lives: the node's lookups through the socket it left, and other
    nodes' hops to its port, fail at once instead of each waiting out its bound."""
    script = _PRELUDE + """
print(json.dumps({"child": child, "tcp": agent.endpoint, "unix": agent.local_endpoint}),
      flush=True)
os.kill(os.getpid(), 9)
"""
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "pool")],
                            stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    seen = json.loads(proc.stdout.readline())
    child = int(seen["child"])
    try:
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert Path(seen["unix"].removeprefix("unix:")).exists()  # left behind
        start = time.monotonic()
        assert lookup(Artifact("a", SHA), Tier(seen["unix"], KEY, bound=6.0)) is None
        local = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises(PeerError) as raised:
            _client.fetch(seen["tcp"], KEY, Artifact("a", SHA), fill=False, timeout=6)
        remote = time.monotonic() - start
    finally:
        os.kill(child, signal.SIGKILL)
        proc.stdout.close()
    assert local < 3.0
    assert remote < 3.0
    assert raised.value.status is None  # type: ignore[attr-defined]


def test_a_forked_child_closing_the_session_returns_and_leaves_the_parents_agent(
        tmp_path: Path) -> None:
    """A child that closes the session it inherited returns at once, and removes
    neither the socket nor the key of the parent's agent, which still serves."""
    got = _run(tmp_path, """
os.write(hold_w, b"x")
os.waitpid(child, 0)  # the first child is not needed here
closer = os.fork()
if closer == 0:
    Hosted(None, agent).close()
    os._exit(0)
deadline = time.monotonic() + 10
returned = False
while time.monotonic() < deadline:
    if os.waitpid(closer, os.WNOHANG)[0]:
        returned = True
        break
    time.sleep(0.05)
if not returned:
    os.kill(closer, 9)
    os.waitpid(closer, 0)
files = [Path(agent.socket_path).exists(), Path(str(agent.socket_path) + ".key").exists()]
try:
    served = _client.fetch(agent.local_endpoint, key, Artifact("a", sha), fill=False,
                           timeout=5).source
except Exception as exc:
    served = type(exc).__name__
Hosted(None, agent).close()
print(json.dumps({"returned": returned, "files": files, "served": served}))
""")
    assert got == {"returned": True, "files": [True, True], "served": "pool"}
