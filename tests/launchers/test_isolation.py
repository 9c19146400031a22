"""distcache's communicators are its own: the engine's survive distcache's start-up,
timeouts and failures, under real launchers (``isolation_prog.py`` is the engine)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.testing import LoopbackOrigin, make_artifacts
from tests.launchers.procs import BIN, PY, base_env, run_group

K = 64
MPIRUN_2 = [str(BIN / "mpirun"), "-n", "2", "--oversubscribe"]
TORCHRUN_2 = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
PROG = ["-m", "tests.launchers.isolation_prog"]


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[LoopbackOrigin, Path]]:
    make_artifacts(tmp_path / "origin", K, min_size=1_000, max_size=20_000, seed=12)
    with LoopbackOrigin(tmp_path / "origin") as srv:
        yield srv, tmp_path / "origin" / "checksums.txt"


def _run(launcher: list[str], scenario: str, tmp: Path, srv: LoopbackOrigin,
         manifest: Path, ranks: int = 2) -> list[dict[str, Any]]:
    out = tmp / f"out-{scenario}"
    out.mkdir()
    # torchrun runs a script path or -m module with its own flag.
    program = ["-m", PROG[1]] if "torchrun" in launcher[0] else [PY, *PROG]
    done = run_group([*launcher, *program, scenario, str(tmp / f"pool-{scenario}"), srv.url,
                      str(manifest), str(out)], base_env(), timeout=150)
    assert done.returncode == 0, done.output
    records = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]
    return records


def test_init_before_the_engines_group_leaves_torch_distributed_to_the_engine(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    records = _run(TORCHRUN_2, "init-then-engine", tmp_path, srv, manifest)
    for rec in records:
        assert rec["initialised_after_init"] is False, rec
        assert (rec["before_close"], rec["after_close"]) == (2, 2), rec
    assert srv.total_requests == K  # and distcache still fetched each artifact once


def test_rank0_alone_under_mpirun_gets_a_typed_error_and_the_world_still_reduces(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    records = _run(MPIRUN_2, "mpi-rank0-alone", tmp_path, srv, manifest)
    alone = records[0]
    assert alone["error"] == "CollectiveTimeout", alone
    assert "TimeoutError" in alone["error_bases"] and "did not arrive" in alone["message"]
    assert alone["seconds"] < 30, alone
    assert [rec["after"] for rec in records] == [2, 2]
    assert srv.total_requests == 0


def test_rank0_alone_after_the_engines_group_gets_a_typed_error_and_the_group_still_reduces(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    records = _run(TORCHRUN_2, "engine-then-rank0-alone", tmp_path, srv, manifest)
    alone = records[0]
    assert alone["error"] in ("CommError", "CollectiveTimeout"), alone
    assert "DistcacheError" in alone["error_bases"]
    assert alone["seconds"] < 30, alone
    assert [rec["after"] for rec in records] == [2, 2]
    assert srv.total_requests == 0


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_background_prefetch_runs_beside_the_engines_collectives_and_reports_alike(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path], launcher: str
) -> None:
    srv, manifest = origin
    cmd = MPIRUN_2 if launcher == "mpirun" else TORCHRUN_2
    background = _run(cmd, "background", tmp_path, srv, manifest)
    assert srv.total_requests == K
    foreground = _run(cmd, "foreground", tmp_path, srv, manifest)
    assert srv.total_requests == 2 * K  # fresh pools: K again, once each
    for rec in background:
        assert rec["engine_sums_right"] is True and rec["engine_reductions"] >= 1, rec
        assert rec["after"] == 2
    # How the objects were cut into buckets depends on when each download landed (the
    # move runs beside them): every other figure is the same.
    timed = ("broadcasts", "broadcast_bytes", "peak_bytes")

    def untimed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r["report"].items() if k not in timed} for r in records]

    assert untimed(background) == untimed(foreground)
    assert len({r["report"]["broadcasts"] for r in background}) == 1
    assert background[0]["report"]["downloads"] == K
