"""A node agent's key file and socket go with its process, closed session or not.

A job whose ranks exit without ``Session.close()`` (a script that ends, an uncaught
error) left the agent's ``.peer-<id>.sock`` and its key file in the pool: an exit hook
now removes them. A child forked from the agent's process and exiting normally
leaves them in place (they are its parent's), and a closed agent's hook is dropped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.cli import REPO

_SCRIPT = """
import json, os, sys
from distcache import ArtifactPool
from distcache.peer._hosting import Hosted, host_agent
from distcache.peer._tier import key_path

pool = ArtifactPool(sys.argv[1])
agent = host_agent(pool, lambda: None, os.urandom(32), "exit-test")
files = [str(agent.socket_path), str(key_path(agent.socket_path))]
said = {"files": files, "made": [os.path.exists(f) for f in files]}
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit, with the parent's exit hooks
os.waitpid(pid, 0)
said["after_child"] = [os.path.exists(f) for f in files]
if sys.argv[2] == "close":
    Hosted(None, agent).close()
    said["after_close"] = [os.path.exists(f) for f in files]
print(json.dumps(said))
"""


def _run(tmp_path: Path, how: str) -> dict[str, list[object]]:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "pool"), how],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    said: dict[str, list[object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return said


def test_an_agents_files_go_when_its_process_exits_without_closing(tmp_path: Path) -> None:
    said = _run(tmp_path, "exit")
    assert said["made"] == [True, True]
    assert said["after_child"] == [True, True]  # the child's exit left them alone
    assert not any(Path(str(f)).exists() for f in said["files"])


def test_a_closed_agent_leaves_nothing_either(tmp_path: Path) -> None:
    said = _run(tmp_path, "close")
    assert said["after_close"] == [False, False]
    assert not any(Path(str(f)).exists() for f in said["files"])
    assert list((tmp_path / "pool").glob(".peer-*")) == []
