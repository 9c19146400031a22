"""FlashInfer under real ``mpirun`` launches on two simulated nodes (2 ranks each).

The origin runs in the pytest process, outside every launch, so its request counter
spans launches. Each rank gets its own ``FLASHINFER_CUBIN_DIR`` through the
environment before FlashInfer is imported (as TensorRT-LLM's per-rank slots do);
each simulated node has its own pool (``DISTCACHE_POOL`` per MPMD context).

Run as a script, this file is the per-rank worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = ("node-a", "node-b")
RANKS_PER_NODE = 2
K = 4
LAUNCH_TIMEOUT = 180


def _worker(mode: str, base: Path, names_file: Path) -> int:
    """One rank. ``run1``: FlashInfer alone fetches set X on every rank, then the
    wrapper (recording) serves kernels A and B of set Y on rank 0 only. ``run2``:
    ``distcache prefetch --flashinfer --record`` (the CLI handler, collective), then
    every rank asks for A through the wrapper; rank 0 reads the origin's counters
    over HTTP between the phases."""
    import argparse
    import warnings

    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ["FLASHINFER_CUBIN_DIR"] = str(base / f"fi-{mode}-r{rank}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as loader_module

    from distcache.cli._prefetch import add_parser
    from distcache.comm import auto
    from distcache.integrations import flashinfer as fi
    from distcache.store._pool import ArtifactPool
    from tests.support.helpers import origin_requests as counted_requests

    comm = auto()
    url = os.environ["FLASHINFER_CUBINS_REPOSITORY"]

    def origin_requests() -> int:
        return counted_requests(comm, url)

    pairs = [line.split("  ", 1) for line in names_file.read_text().splitlines()]
    set_x, set_y = pairs[:K], pairs[K:]
    result: dict[str, object] = {"rank": rank}
    if mode == "run1":
        for sha, name in set_x:
            assert hashlib.sha256(loader_module.get_artifact(name, sha)).hexdigest() == sha
        result["after_own"] = origin_requests()
        fi.install(ArtifactPool(os.environ["DISTCACHE_POOL"]), record=base / "record")
        for sha, name in set_y[:2] if rank == 0 else []:
            assert hashlib.sha256(loader_module.get_artifact(name, sha)).hexdigest() == sha
        fi.uninstall()
        result["after_record"] = origin_requests()
    else:
        parser = argparse.ArgumentParser(prog="distcache")
        add_parser(parser.add_subparsers())
        args = parser.parse_args(["prefetch", "--flashinfer", "--record", str(base / "record")])
        assert args.func(args) == 0
        result["after_prefetch"] = origin_requests()
        loader = fi.install(ArtifactPool(os.environ["DISTCACHE_POOL"]))
        assert loader is not None
        sha, name = set_y[0]
        result["digest"] = hashlib.sha256(loader_module.get_artifact(name, sha)).hexdigest()
        result.update(
            hits=loader.stats.hits, fetched=loader.stats.fetched, fallbacks=loader.stats.fallbacks
        )
        fi.uninstall()
        result["after_serve"] = origin_requests()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))


# --- the tests ------------------------------------------------------------------------

from tests.support.helpers import mpi_env, mpmd_command, run_group  # noqa: E402


def _launch(program: list[str], base: Path, pool_tag: str, url: str) -> list[dict[str, object]]:
    """``mpirun`` with one MPMD context per simulated node; returns RESULT lines."""
    cmd = mpmd_command(
        [
            (
                RANKS_PER_NODE,
                {
                    "DISTCACHE_NODE_ID": node,
                    "DISTCACHE_POOL": str(base / f"pool-{pool_tag}-{node}"),
                },
                program,
            )
            for node in NODES
        ]
    )
    env = mpi_env(
        FLASHINFER_CUBINS_REPOSITORY=url, DISTCACHE_TIMEOUT="120", DISTCACHE_HTTP_RETRIES="0"
    )
    for var in (
        "DISTCACHE_ORIGIN",
        "DISTCACHE_DISABLE",
        "DISTCACHE_FLASHINFER",
        "FLASHINFER_CUBIN_DIR",
        "FLASHINFER_NO_DOWNLOAD",
    ):
        env.pop(var, None)
    done = run_group(cmd, timeout=LAUNCH_TIMEOUT, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [
        json.loads(line[len("RESULT ") :])
        for line in done.stdout.splitlines()
        if line.startswith("RESULT ")
    ]


@pytest.mark.slow
def test_flashinfer_fetches_per_rank_distcache_once_per_job(tmp_path: Path) -> None:
    from distcache.testing import LoopbackOrigin, make_artifacts

    made = make_artifacts(tmp_path / "repo", K + 2, min_size=2_000, max_size=20_000)
    names = tmp_path / "names.txt"
    names.write_text("".join(f"{a.sha256}  {a.name}\n" for a in made))
    worker = [sys.executable, str(Path(__file__).resolve())]
    ranks = len(NODES) * RANKS_PER_NODE

    with LoopbackOrigin(tmp_path / "repo") as origin:
        run1 = _launch([*worker, "run1", str(tmp_path), str(names)], tmp_path, "run1", origin.url)
        run2 = _launch([*worker, "run2", str(tmp_path), str(names)], tmp_path, "run2", origin.url)
        total = origin.total_requests
    assert len(run1) == len(run2) == ranks
    first, second = run1[0], run2[0]
    # FlashInfer alone: every rank downloads each of the K artifacts.
    assert first["after_own"] == ranks * K
    # Run 1 with the wrapper: rank 0 alone fetched A and B (and recorded them).
    assert first["after_record"] == ranks * K + 2
    # One record file for the one host (run 2's read compacts it; the lock is hidden).
    records = [p for p in (tmp_path / "record").iterdir() if not p.name.startswith(".")]
    assert len(records) == 1, records
    # Run 2: the recorded prefetch fetches A and B once per job into both node pools...
    assert second["after_prefetch"] == ranks * K + 4
    # ...so serving A on every rank is a pool hit with no origin request.
    assert second["after_serve"] == total == ranks * K + 4
    assert all(r["hits"] == 1 and r["fetched"] == 0 and r["fallbacks"] == 0 for r in run2)
    assert {r["digest"] for r in run2} == {made[K].sha256}
