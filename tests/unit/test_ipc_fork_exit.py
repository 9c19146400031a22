"""A child forked after IPC set-up exits without undoing its parent's.

The finalizers of a consumer's registry and of a producer's segment are inherited by
a child the process forks (a helper, a data-loader worker). At the child's normal
exit they ran there: the registry's marked the parent's consumer row as gone, so the
producer reclaimed the parent's leases and overwrote a view it was still reading, and
the segment's unlinked the parent's segment name before its consumers mapped it. They
now run only in the process that set them up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import REPO

pytest.importorskip("torch")

_CONSUMER = """
import json, os, torch
from distcache.ipc import PoolRegistry, ShmPool

pool = ShmPool(1 << 12, consumers=[1], name="forkleave{tag}")
pool.bind(owner=0, consumers=[1])
registry = PoolRegistry(rank=1)
registry.add(pool.descriptor().pack())
pool.unlink()
ref = pool.put(torch.full((256,), 7, dtype=torch.int32))
view = registry.resolve(ref)
if os.fork() == 0:
    raise SystemExit(0)  # a normal exit: the inherited finalizers run
os.wait()
freed = pool.reclaim()
others = [pool.put(torch.full((256,), 99, dtype=torch.int32)) for _ in range(4)]
said = {{"freed": freed, "view": int(view[0]),
         "reused": any(r is not None and r.offset == ref.offset for r in others)}}
registry.ack(ref)
del view
registry.close(); pool.close()
print(json.dumps(said))
"""

_PRODUCER = """
import json, os
from distcache.ipc import PoolRegistry, ShmPool

pool = ShmPool(1 << 12, consumers=[1], name="forkunlink{tag}")
pool.bind(owner=0, consumers=[1])
if os.fork() == 0:
    raise SystemExit(0)
os.wait()
said = {{"linked": os.path.exists(pool.path)}}
registry = PoolRegistry(rank=1)
registry.add(pool.descriptor().pack())  # a consumer maps it by its name
said["mapped"] = True
registry.close(); pool.close()
print(json.dumps(said))
"""


def _run(script: str, tmp_path: Path) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", script.format(tag=tmp_path.name[-8:])],
                          capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    said: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return said


def test_a_forked_childs_exit_leaves_the_parents_leases_alone(tmp_path: Path) -> None:
    said = _run(_CONSUMER, tmp_path)
    assert said == {"freed": 0, "view": 7, "reused": False}, said


def test_a_forked_childs_exit_leaves_the_parents_segment_linked(tmp_path: Path) -> None:
    said = _run(_PRODUCER, tmp_path)
    assert said == {"linked": True, "mapped": True}, said
