"""An air-gapped start under ``mpirun``: the pool is seeded with the command line, then
4 ranks whose code never calls distcache (the opt-in start-up hook installs the
wrapper) run FlashInfer's real loader with ``DISTCACHE_OFFLINE=1``. Every artifact
comes from the pool, an unknown one is refused with FlashInfer's own error and
distcache's line naming it, and the origin (set for both distcache and FlashInfer)
sees no request.

``DISTCACHE_TEST_CUBIN_WHEEL=PATH`` (a ``flashinfer-cubin`` wheel) adds the same check
seeded from that wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.helpers import mpi_env, mpirun, run_group

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "engine_worker.py"
RANKS = 4
LAUNCH_TIMEOUT = 300
UNKNOWN = ("0123456789abcdef0123456789abcdef01234567/fmha/trtllm-gen/unknownKernel.cubin",
           "ab" * 32)


def cli(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return run_group([sys.executable, "-m", "distcache", *map(str, args)], timeout=timeout,
                     env=mpi_env(), cwd=REPO)


def offline_launch(tmp: Path, pool: Path, checksums: Path, url: str) -> tuple[list[dict], str]:
    env = mpi_env(
        DISTCACHE_POOL=str(pool), DISTCACHE_OFFLINE="1", DISTCACHE_AUTOINSTALL="1",
        DISTCACHE_ORIGIN=url, FLASHINFER_CUBINS_REPOSITORY=url,
        FLASHINFER_CUBIN_DIR=str(tmp / "cubins"), PYTHONWARNINGS="ignore",
        DISTCACHE_LOG_JSON=str(tmp / "events.jsonl"),
    )
    for var in ("DISTCACHE_DISABLE", "DISTCACHE_FLASHINFER", "FLASHINFER_NO_DOWNLOAD"):
        env.pop(var, None)
    cmd = [mpirun(), "--oversubscribe", "-n", str(RANKS), sys.executable, str(WORKER),
           "plain", str(checksums), *UNKNOWN]
    done = run_group(cmd, timeout=LAUNCH_TIMEOUT, env=env, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return results, done.stderr


def check_offline(results: list[dict], stderr: str, count: int, total_requests: int) -> None:
    assert sorted(r["rank"] for r in results) == [str(r) for r in range(RANKS)]
    for result in results:
        assert result["loader"] == "PooledLoader"
        assert result["all_matched"] and result["count"] == count
        assert result["stats"]["hits"] == count and result["stats"]["fetched"] == 0
        assert result["stats"]["offline_misses"] == 1
        # FlashInfer's own refusal, unchanged...
        assert result["unknown_error"].startswith(
            f"RuntimeError: Artifact not found locally: {UNKNOWN[0]}")
    # ...and distcache's line naming the artifact and how to fetch it, once per rank.
    lines = [ln for ln in stderr.splitlines() if "DISTCACHE_OFFLINE=1" in ln]
    assert len(lines) == RANKS and all(UNKNOWN[0] in ln and "distcache fetch" in ln
                                       for ln in lines)
    assert total_requests == 0


@pytest.mark.slow
def test_air_gapped_start_serves_every_rank_from_the_pool(tmp_path: Path) -> None:
    made = make_artifacts(tmp_path / "set", 6, min_size=2_000, max_size=20_000)
    pool = tmp_path / "pool"
    imported = cli("pool", "--pool", pool, "import", tmp_path / "set")
    assert imported.returncode == 0, imported.stderr
    checksums = tmp_path / "wanted.txt"
    checksums.write_text("".join(f"{a.sha256}  {a.name}\n" for a in made))
    (tmp_path / "empty").mkdir()
    with LoopbackOrigin(tmp_path / "empty") as origin:
        results, stderr = offline_launch(tmp_path, pool, checksums, origin.url)
        total = origin.total_requests
    check_offline(results, stderr, len(made), total)
    events = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "flashinfer.offline_miss" for e in events) == RANKS
    assert [e["hits"] for e in events if e["event"] == "flashinfer.loader"] == [6] * RANKS


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DISTCACHE_TEST_CUBIN_WHEEL"),
                    reason="set DISTCACHE_TEST_CUBIN_WHEEL to a flashinfer-cubin wheel "
                           "(scripts/test.sh runs it in a step of its own)")
def test_air_gapped_start_from_a_flashinfer_cubin_wheel(tmp_path: Path) -> None:
    wheel = Path(os.environ["DISTCACHE_TEST_CUBIN_WHEEL"])
    pool = tmp_path / "pool"
    started = time.monotonic()
    imported = cli("pool", "--pool", pool, "import", wheel, timeout=1800)
    seconds = time.monotonic() - started
    assert imported.returncode == 0, imported.stderr
    listed = cli("pool", "--pool", pool, "ls")
    assert listed.returncode == 0, listed.stderr
    cubins = [ln for ln in listed.stdout.splitlines() if ln.endswith(".cubin")]
    print(f"imported {wheel.name} in {seconds:.0f} s: {len(listed.stdout.splitlines())} "
          f"names, {len(cubins)} cubins")
    sample = cubins[:: max(1, len(cubins) // 24)][:24]
    checksums = tmp_path / "wanted.txt"
    checksums.write_text("".join(ln + "\n" for ln in sample))
    (tmp_path / "empty").mkdir()
    with LoopbackOrigin(tmp_path / "empty") as origin:
        results, stderr = offline_launch(tmp_path, pool, checksums, origin.url)
        total = origin.total_requests
    check_offline(results, stderr, len(sample), total)
