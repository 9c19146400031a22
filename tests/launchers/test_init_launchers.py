"""distcache.init and `python -m launch --prefetch` under real launchers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from distcache.artifact import parse_checksums
from distcache.store._pool import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.launchers.procs import LAUNCH, MPIRUN_4, PY, SRUN_4, TORCHRUN_4, base_env, run_group
from tests.support.helpers import mpmd_command

INIT_PROG = Path(__file__).with_name("init_prog.py")
K = 6
_INIT = re.compile(r"INIT (\d+) (\d+) (\w+) (\d+) (\d+) (\d+)")


class Row(NamedTuple):
    """One rank's ``INIT`` line."""

    rank: int
    size: int
    backend: str
    downloads: int
    objects: int
    broadcast_bytes: int


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[LoopbackOrigin, Path]]:
    make_artifacts(tmp_path / "origin", K, min_size=2_000, max_size=30_000, seed=5)
    with LoopbackOrigin(tmp_path / "origin") as srv:
        yield srv, tmp_path / "origin" / "checksums.txt"


def _rows(output: str) -> list[Row]:
    # Ranks share one pipe, so a line may be glued to another rank's line.
    rows = [
        Row(int(r), int(s), b, int(d), int(o), int(m)) for r, s, b, d, o, m in _INIT.findall(output)
    ]
    return sorted(rows)


def test_init_under_torchrun_brings_up_torch_and_fetches_once(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    done = run_group(
        [*TORCHRUN_4, str(INIT_PROG), str(tmp_path / "pool"), srv.url, str(manifest)], base_env()
    )
    assert done.returncode == 0, done.output
    rows = _rows(done.output)
    assert [(r.rank, r.size, r.backend) for r in rows] == [(r, 4, "gloo") for r in range(4)], (
        done.output
    )
    # One shared pool: every rank reports the job's download count and a full pool.
    assert {r.downloads for r in rows} == {K}
    assert {r.objects for r in rows} == {K}
    assert srv.total_requests == K


def test_init_under_mpirun_adopts_mpi_with_per_node_pools(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    cmd = mpmd_command(
        [
            (
                2,
                {"DISTCACHE_NODE_ID": node},
                [PY, INIT_PROG, tmp_path / "pools" / node, srv.url, manifest],
            )
            for node in ("a", "b")
        ]
    )
    done = run_group(cmd, base_env())
    assert done.returncode == 0, done.output
    rows = _rows(done.output)
    assert [(r.rank, r.size, r.backend) for r in rows] == [(r, 4, "mpi") for r in range(4)], (
        done.output
    )
    assert {r.objects for r in rows} == {K}
    assert srv.total_requests == K


def test_init_under_srun_meets_on_a_store_of_its_own_and_fetches_once(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path], slurm_env: dict[str, str]
) -> None:
    # srun has no agent store: rank 0 hosts distcache's one port above MASTER_PORT,
    # which stays free for the engine's own env:// rendezvous.
    srv, manifest = origin
    done = run_group([*SRUN_4, PY, str(INIT_PROG), str(tmp_path / "pools" / "{rank}"), srv.url,
                      str(manifest)], slurm_env)
    assert done.returncode == 0, done.output
    rows = _rows(done.output)
    assert [(r.rank, r.size, r.backend) for r in rows] == [(r, 4, "gloo") for r in range(4)], (
        done.output
    )
    assert {r.objects for r in rows} == {K}
    assert srv.total_requests == K
    assert {r.broadcast_bytes for r in rows} != {0}  # four pools: bytes moved between ranks


@pytest.mark.parametrize("layout", ["pool-per-rank", "shared-pool"])
def test_prefetch_under_torchrun_fetches_each_artifact_once_and_nothing_on_a_second_run(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path], layout: str
) -> None:
    srv, manifest = origin
    pools = tmp_path / "pools"
    pool_arg = str(pools / "{rank}") if layout == "pool-per-rank" else str(pools / "shared")
    cmd = [*TORCHRUN_4, str(INIT_PROG), pool_arg, srv.url, str(manifest)]
    artifacts = parse_checksums(manifest.read_text())
    shas = sorted(a.sha256 for a in artifacts)
    names = {a.name: a.sha256 for a in artifacts}

    done = run_group(cmd, base_env())
    assert done.returncode == 0, done.output
    rows = _rows(done.output)
    assert [(r.rank, r.size, r.backend) for r in rows] == [(r, 4, "gloo") for r in range(4)], (
        done.output
    )
    assert srv.total_requests == K
    assert srv.requests == {name: 1 for name in names}
    assert {r.downloads for r in rows} == {K} and {r.objects for r in rows} == {K}
    dirs = sorted(p for p in pools.iterdir() if p.is_dir())
    assert len(dirs) == (4 if layout == "pool-per-rank" else 1)
    if layout == "pool-per-rank":
        # Three of the four pools lack each object, so bytes must have moved.
        assert {r.broadcast_bytes for r in rows} != {0}
    for path in dirs:
        pool = ArtifactPool(path)
        assert sorted(pool.objects()) == shas and pool.names() == names
        checked = pool.verify()
        assert (checked.ok, checked.corrupt) == (K, 0)

    srv.reset()
    again = run_group(cmd, base_env())
    assert again.returncode == 0, again.output
    rows = _rows(again.output)
    assert [r.rank for r in rows] == [0, 1, 2, 3], again.output
    assert srv.total_requests == 0
    assert {(r.downloads, r.broadcast_bytes, r.objects) for r in rows} == {(0, 0, K)}


def test_launch_prefetch_warms_the_pool_before_the_program_starts(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    srv, manifest = origin
    pool = tmp_path / "pool"
    # The program is an MPI engine of its own: after the wrapper's prefetch (on a
    # duplicate of the world, freed before the program starts) it makes its own
    # MPI_Init and reduces over the world.
    check = (
        "import os, sys; from distcache.store._pool import ArtifactPool; "
        "p = ArtifactPool(os.environ['DISTCACHE_POOL']); "
        "from mpi4py import MPI; total = MPI.COMM_WORLD.allreduce(1); "
        "print('OBJECTS', os.environ['RANK'], sum(1 for _ in p.objects()), total, flush=True)"
    )
    done = run_group(
        [
            *MPIRUN_4,
            *LAUNCH,
            "--pool",
            str(pool),
            "--prefetch",
            str(manifest),
            "--",
            PY,
            "-c",
            check,
        ],
        base_env(DISTCACHE_ORIGIN=srv.url),
    )
    assert done.returncode == 0, done.output
    counts = sorted(re.findall(r"OBJECTS (\d) (\d+) (\d+)", done.output))
    assert counts == [(str(r), str(K), "4") for r in range(4)], done.output
    assert srv.total_requests == K
    assert "prefetch:" in done.output


UNMODIFIED_FLASHINFER = """
import os, sys, warnings
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import flashinfer.jit.cubin_loader as loader
from distcache.artifact import read_manifest
for a in read_manifest(sys.argv[1]):
    assert loader.get_artifact(a.name, a.sha256), a.name
print("SERVED", os.environ["RANK"], flush=True)
"""


def test_an_unmodified_flashinfer_engine_loads_locally_after_launch_prefetch(
    tmp_path: Path, origin: tuple[LoopbackOrigin, Path]
) -> None:
    # FlashInfer's own get_artifact reads FLASHINFER_CUBIN_DIR/<name> (checking its
    # SHA-256) before it would download: after `python -m launch --prefetch` linked the
    # prefetched artifacts there, the engine's loads never reach the origin.
    srv, manifest = origin
    engine = tmp_path / "engine.py"
    engine.write_text(UNMODIFIED_FLASHINFER)
    cubin_dir = tmp_path / "flashinfer-cubins"
    done = run_group(
        [
            *MPIRUN_4,
            *LAUNCH,
            "--pool",
            str(tmp_path / "pool"),
            "--prefetch",
            str(manifest),
            "--",
            PY,
            str(engine),
            str(manifest),
        ],
        base_env(
            DISTCACHE_ORIGIN=srv.url,
            FLASHINFER_CUBINS_REPOSITORY=srv.url,
            FLASHINFER_CUBIN_DIR=str(cubin_dir),
        ),
        timeout=300,
    )
    assert done.returncode == 0, done.output
    assert sorted(re.findall(r"SERVED (\d)", done.output)) == ["0", "1", "2", "3"], done.output
    # K requests from the prefetch, none from the four engines.
    assert srv.total_requests == K
    names = {a.name for a in parse_checksums(manifest.read_text())}
    assert {
        p.relative_to(cubin_dir).as_posix() for p in cubin_dir.rglob("*") if p.is_file()
    } == names
