"""A lazy miss once per job across nodes, under real ``mpirun``: 4 simulated nodes x 2
ranks, one pool per node, FlashInfer's real ``get_artifact``, the counting loopback
origin in the pytest process (its counter spans every launch).

Without peers each node's pool downloads every artifact once: 4 x 32 = 128 requests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from distcache.peer import LOOKUP_BOUND_S
from tests.support.helpers import mpi_env, mpmd_command, run_group

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "peer_worker.py"
NODES = ("node-a", "node-b", "node-c", "node-d")
RANKS_PER_NODE = 2
LAUNCH_TIMEOUT = 240


def _env(url: str, **extra: str) -> dict[str, str]:
    env = mpi_env(FLASHINFER_CUBINS_REPOSITORY=url, DISTCACHE_TIMEOUT="120",
                  DISTCACHE_HTTP_RETRIES="0", **extra)
    for var in ("DISTCACHE_ORIGIN", "DISTCACHE_DISABLE", "DISTCACHE_FLASHINFER",
                "DISTCACHE_PEERS", "FLASHINFER_CUBIN_DIR", "FLASHINFER_NO_DOWNLOAD"):
        env.pop(var, None)
    return env


def launch(base: Path, mode: str, url: str, *, program: list[str] | None = None,
           recovery: bool = False, **extra: str) -> tuple[int, list[dict[str, Any]]]:
    """One MPMD ``mpirun`` (a context per simulated node); the RESULT lines."""
    names = base / "names.txt"
    argv = program or [sys.executable, str(WORKER), mode, str(base), str(names)]
    cmd = mpmd_command([(RANKS_PER_NODE, {"DISTCACHE_NODE_ID": node,
                                          "DISTCACHE_POOL": str(base / f"pool-{mode}-{node}")},
                         argv) for node in NODES])
    if recovery:  # a rank killed on purpose must not take the job down
        cmd.insert(1, "--enable-recovery")
    done = run_group(cmd, timeout=LAUNCH_TIMEOUT, env=_env(url, **extra), cwd=REPO)
    results = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]
    if not recovery:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, results


@pytest.fixture
def origin(tmp_path: Path) -> Any:
    from distcache.testing import LoopbackOrigin, make_artifacts

    made = make_artifacts(tmp_path / "repo", 64, min_size=2_000, max_size=12_000)
    (tmp_path / "names.txt").write_text("".join(f"{a.sha256}  {a.name}\n" for a in made))
    with LoopbackOrigin(tmp_path / "repo", latency=0.05) as served:
        yield served


@pytest.mark.slow
def test_warm_up_then_burst_and_all_at_once_each_cost_one_request_per_artifact(
    tmp_path: Path, origin: Any
) -> None:
    _, results = launch(tmp_path, "phases", origin.url)
    assert len(results) == len(NODES) * RANKS_PER_NODE
    first = results[0]
    assert first["after_warmup"] == 32  # rank 0 alone: one request per artifact
    assert first["after_burst"] == 32  # every rank of every node: nothing more
    assert first["after_at_once"] == 64  # set B, 8 ranks at once: 32 more
    assert origin.total_requests == 64
    assert all(r["right"] for r in results)
    assert all(r["longest"] < LOOKUP_BOUND_S for r in results)
    stats = [r["stats"] for r in results]
    assert sum(s["peer_failed"] + s["fallbacks"] + s["peer_fallbacks"] for s in stats) == 0
    for result in results:  # every lookup is counted once, by where its bytes came from
        asked = 96 if result["rank"] == 0 else 64
        s = result["stats"]
        assert s["hits"] + s["fetched"] + s["peer"] == asked, result
    # Set B, asked at once: on the 3 nodes that do not own an artifact it came from the
    # owner's agent (each node's two ranks share that one copy).
    assert sum(s["peer"] for s in stats) >= 3 * 32


@pytest.mark.slow
def test_the_owner_node_killed_mid_burst_costs_only_what_it_owned(
    tmp_path: Path, origin: Any
) -> None:
    _, results = launch(tmp_path, "kill", origin.url, recovery=True)
    victims = [r for r in results if r["victim"]]
    survivors = [r for r in results if not r["victim"]]
    assert {r["node"] for r in victims} == {"node-a"}
    assert len(survivors) == (len(NODES) - 1) * RANKS_PER_NODE, results
    assert all(r["right"] for r in survivors)
    assert all(r["longest"] < LOOKUP_BOUND_S for r in survivors)
    owned = victims[0]["owned_by_first"]
    assert 32 <= origin.total_requests <= 32 + owned, (results, origin.requests)


@pytest.mark.slow
def test_a_program_under_launch_that_never_calls_distcache_costs_one_request_per_artifact(
    tmp_path: Path, origin: Any
) -> None:
    program = [sys.executable, "-m", "launch", "--peers", "--", sys.executable, str(WORKER),
               "launch", str(tmp_path), str(tmp_path / "names.txt")]
    _, results = launch(tmp_path, "launch", origin.url, program=program,
                        DISTCACHE_AUTOINSTALL="1")
    assert len(results) == len(NODES) * RANKS_PER_NODE
    assert all(r["right"] for r in results)
    assert origin.total_requests == 32
    stats = [r["stats"] for r in results]
    assert sum(s["peer_failed"] + s["fallbacks"] for s in stats) == 0
    assert sum(s["peer"] for s in stats) >= 3 * 32  # the other nodes copied, not fetched
