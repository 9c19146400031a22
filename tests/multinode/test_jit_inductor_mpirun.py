"""Inductor's compile cache through the pool under ``mpirun``: 2 simulated nodes x 2
ranks, node-local pools and a ``TORCHINDUCTOR_CACHE_DIR`` per node.

The first launch compiles on every rank (Inductor counts ``fxgraph_cache_miss``) and
``session.sync()`` publishes what each node built and moves it to the other pool. Node
B's cache directory and pool are then emptied: the second launch fills node B's
directory from node A's pool at ``init`` and every rank counts ``fxgraph_cache_hit``
and no miss, while the origin (set for the job) sees no request. Counted with
Inductor's own counters, never timed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from distcache import jit
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin
from tests.support.helpers import mpi_env, mpmd_command, run_group

pytest.importorskip("torch")

WORKER = Path(__file__).with_name("jit_worker.py")
NODES = ("a", "b")
RANKS_PER_NODE = 2
LAUNCH_TIMEOUT = 420.0


def launch(tmp: Path, url: str, *args: str) -> list[dict]:
    contexts = []
    for node in NODES:
        variables = {"DISTCACHE_NODE_ID": node, "DISTCACHE_POOL": str(tmp / f"pool-{node}"),
                     "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{node}"),
                     "DISTCACHE_ORIGIN": url, "TORCHINDUCTOR_COMPILE_THREADS": "1",
                     "OMP_NUM_THREADS": "1"}
        contexts.append((RANKS_PER_NODE, variables, [sys.executable, str(WORKER), *args]))
    env = mpi_env()
    for var in ("DISTCACHE_DISABLE", "DISTCACHE_JIT_CACHES", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(var, None)
    done = run_group(mpmd_command(contexts), timeout=LAUNCH_TIMEOUT, env=env, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert sorted(r["rank"] for r in records) == list(range(len(NODES) * RANKS_PER_NODE))
    return records


@pytest.mark.slow
def test_a_node_with_an_empty_cache_and_pool_starts_warm(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with LoopbackOrigin(tmp_path / "empty") as origin:
        first = launch(tmp_path, origin.url, "--sync")
        assert all(r["miss"] >= 1 for r in first), first
        assert sum(sum(r["published"]) for r in first) > 0
        # What node B built reached node A's pool; then node B loses everything.
        shutil.rmtree(tmp_path / "inductor-b")
        shutil.rmtree(tmp_path / "pool-b")
        pool_a = ArtifactPool(tmp_path / "pool-a")
        for node in NODES:
            key = jit.family("inductor", environ={
                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{node}")}).key
            assert jit.read_trees(pool_a, "inductor", key), f"node {node}'s tree is not in A"
        second = launch(tmp_path, origin.url)
        requests = origin.total_requests
    for record in second:
        assert record["hit"] >= 1 and record["miss"] == 0, record
    on_b = [r for r in second if r["node"] == "b"]
    assert len(on_b) == RANKS_PER_NODE and sum(sum(r["filled"]) for r in on_b) > 0
    assert requests == 0
