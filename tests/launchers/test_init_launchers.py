"""distcache.init and `python -m launch --prefetch` under real launchers."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import manifest_text
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.launchers.procs import BIN, base_env, run_group

PY = sys.executable
INIT_PROG = Path(__file__).with_name("init_prog.py")
K = 6
_INIT = re.compile(r"INIT (\d+) (\d+) (\w+) (\d+) (\d+)")


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[LoopbackOrigin, Path]]:
    artifacts = make_artifacts(tmp_path / "origin", K, min_size=2_000, max_size=30_000, seed=5)
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(manifest_text(artifacts))
    with LoopbackOrigin(tmp_path / "origin") as srv:
        yield srv, manifest


def _rows(output: str) -> list[tuple[int, int, str, int, int]]:
    rows = [(int(r), int(s), b, int(d), int(o)) for r, s, b, d, o in _INIT.findall(output)]
    return sorted(rows)


def test_init_under_torchrun_brings_up_torch_and_fetches_once(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    done = run_group(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", str(INIT_PROG),
         str(tmp_path / "pool"), srv.url, str(manifest)],
        base_env(),
    )
    assert done.returncode == 0, done.output
    rows = _rows(done.output)
    assert [(r, s, b) for r, s, b, _, _ in rows] == [(r, 4, "torch") for r in range(4)], done.output
    # One shared pool: every rank reports the job's download count and a full pool.
    assert {d for _, _, _, d, _ in rows} == {K}
    assert {o for _, _, _, _, o in rows} == {K}
    assert srv.total_requests == K


def test_init_under_mpirun_adopts_mpi_with_per_node_pools(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    cmd = [str(BIN / "mpirun"), "--oversubscribe"]
    for i, node in enumerate(("a", "b")):
        if i:
            cmd.append(":")
        cmd += ["-n", "2", "-x", f"DISTCACHE_NODE_ID={node}", PY, str(INIT_PROG),
                str(tmp_path / "pools" / node), srv.url, str(manifest)]
    done = run_group(cmd, base_env())
    assert done.returncode == 0, done.output
    rows = _rows(done.output)
    assert [(r, s, b) for r, s, b, _, _ in rows] == [(r, 4, "mpi") for r in range(4)], done.output
    assert {o for _, _, _, _, o in rows} == {K}
    assert srv.total_requests == K


def test_launch_prefetch_warms_the_pool_before_the_program_starts(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    pool = tmp_path / "pool"
    check = (
        "import os, sys; from distcache.pool import ArtifactPool; "
        "p = ArtifactPool(os.environ['DISTCACHE_POOL']); "
        "print('OBJECTS', os.environ['RANK'], sum(1 for _ in p.objects()), flush=True)"
    )
    done = run_group(
        [str(BIN / "mpirun"), "-n", "4", "--oversubscribe", PY, "-m", "launch",
         "--pool", str(pool), "--prefetch", str(manifest), "--", PY, "-c", check],
        base_env(DISTCACHE_ORIGIN=srv.url),
    )
    assert done.returncode == 0, done.output
    counts = sorted(re.findall(r"OBJECTS (\d) (\d+)", done.output))
    assert counts == [(str(r), str(K)) for r in range(4)], done.output
    assert srv.total_requests == K
    assert "prefetch:" in done.output
