"""``python -m launch --prefetch`` under ``mpirun -n 2`` on a warm pool: no origin is
configured (or downloads are off) and the program starts on every rank; what the pool
lacks stops the launch with one error naming it, before the program runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import manifest_text
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.launchers.procs import BIN, LAUNCH, PY, base_env, run_group

MPIRUN_2 = [str(BIN / "mpirun"), "-n", "2", "--oversubscribe"]
#: The program prints one line per rank.
PROGRAM = "import os; print('PROGRAM STARTED', os.environ['RANK'], flush=True)"


def _warm(tmp_path: Path, count: int) -> tuple[Path, Path, int]:
    """A pool holding the first ``count`` artifacts of a manifest of 5."""
    artifacts = make_artifacts(tmp_path / "origin", 5, min_size=500, max_size=3_000, seed=9)
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(manifest_text(artifacts))
    pool = ArtifactPool(tmp_path / "pool")
    for a in artifacts[:count]:
        pool.put((tmp_path / "origin" / a.name).read_bytes(), a.sha256)
    return tmp_path / "pool", manifest, len(artifacts)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in base_env().items() if not k.startswith("DISTCACHE_")}
    env.update(extra)
    return env


def _started(output: str) -> list[str]:
    return sorted(line.split()[2] for line in output.splitlines()
                  if line.startswith("PROGRAM STARTED"))


@pytest.mark.parametrize("offline", [False, True], ids=["no-origin", "offline-with-origin"])
def test_a_warm_pool_starts_the_program_on_every_rank_without_an_origin(
    tmp_path: Path, offline: bool
) -> None:
    pool, manifest, _ = _warm(tmp_path, 5)
    with LoopbackOrigin(tmp_path / "origin") as origin:
        extra = {"DISTCACHE_OFFLINE": "1", "DISTCACHE_ORIGIN": origin.url} if offline else {}
        done = run_group([*MPIRUN_2, *LAUNCH, "--pool", str(pool), "--prefetch", str(manifest),
                          "--", PY, "-c", PROGRAM], _env(**extra), timeout=180)
        requests = origin.total_requests
    assert done.returncode == 0, done.output
    assert _started(done.output) == ["0", "1"], done.output
    assert requests == 0


def test_what_the_pool_lacks_stops_the_launch_with_one_error_naming_it(tmp_path: Path) -> None:
    pool, manifest, total = _warm(tmp_path, 3)
    done = run_group([*MPIRUN_2, *LAUNCH, "--pool", str(pool), "--prefetch", str(manifest),
                      "--", PY, "-c", PROGRAM], _env(), timeout=180)
    assert done.returncode != 0, done.output
    assert _started(done.output) == [], done.output
    errors = [line for line in done.output.splitlines() if "are in no pool" in line]
    # The same error on both ranks, printed once for the job (by rank 0).
    assert len(errors) == 1, done.output
    assert errors[0].startswith("python -m launch: error: ")
    assert f"{total - 3} artifact(s) are in no pool and no origin is set" in errors[0]
    assert f"distcache fetch --manifest {manifest} --origin URL" in errors[0]


def _prefetch_command(pool: Path, manifest: Path) -> Any:
    """``distcache prefetch --manifest`` on both ranks of ``mpirun -n 2``."""
    return run_group([*MPIRUN_2, PY, "-m", "distcache", "--pool", str(pool), "prefetch",
                      "--manifest", str(manifest)], _env(), timeout=180)


def test_what_the_pools_lack_stops_the_prefetch_command_with_one_line_per_job(
    tmp_path: Path,
) -> None:
    pool, manifest, total = _warm(tmp_path, 3)
    done = _prefetch_command(pool, manifest)
    assert done.returncode == 1, done.output
    assert f"{total - 3} artifact(s) are in no pool" in done.output
    errors = [line for line in done.output.splitlines() if "are in no pool" in line]
    assert len(errors) == 1, done.output
    assert errors[0].startswith("distcache prefetch: ")


def test_the_prefetch_command_under_mpirun_needs_no_origin_for_a_warm_pool(
    tmp_path: Path,
) -> None:
    pool, manifest, total = _warm(tmp_path, 5)
    done = _prefetch_command(pool, manifest)
    assert done.returncode == 0, done.output
    assert f"{total} already everywhere" in done.output and "; 0 downloads" in done.output
