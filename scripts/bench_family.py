#!/usr/bin/env python
"""A whole kernel family through distcache, next to the floors measured in the same run.

The set is the ``flashinfer-cubin`` package's cubins when it is installed, or
``--cubins DIR|WHEEL`` (a directory, or a wheel whose cubins are extracted under
--work), else a generated set with the same count and size distribution
(``scripts/family_sizes.json``, quantiles of flashinfer-cubin 0.6.13: 15,970 cubins,
1.89 GB). It is served from a directory origin (what ``DISTCACHE_ORIGIN=<dir>`` gives).

Measured, in this order, each in fresh processes:

  copy floor   ``cp`` of the set + SHA-256 of the copy (OpenSSL's, one thread a core)
  cold 1       ``distcache.prefetch`` on 1 rank into an empty pool
  warm 1       the same again, the pool full
  stat floor   one ``os.stat`` per object of that pool
  warm init 1  warm 1 through the public hook: ``import distcache`` and
               ``distcache.init(manifests=[M], integrations=[])`` (below)
  cold 2x2     ``mpirun -n 4``: 2 simulated nodes x 2 ranks, one pool per node
               (``DISTCACHE_NODE_ID`` per rank), each object fetched once per job and
               broadcast to the other node
  warm 2x2     the same again
  warm init 2x2  warm 2x2 through the public hook

The cold and warm rows time ``prefetch()`` alone, the sizes given. The rows through
init count what a user meets: each rank takes its clock before ``import distcache``
and stops it when ``distcache.init(manifests=[M], integrations=[])`` returns (the pool
``DISTCACHE_POOL`` of its node, ``DISTCACHE_NODE_ID``, the same directory origin as
``DISTCACHE_ORIGIN``; the manifest without sizes); the row is the slowest rank.
Under mpirun, ``from mpi4py import MPI`` (MPI_Init: the launcher's and the engine's
cost, about a second for 4 ranks on a 2-core machine) comes before the clock, then
one barrier of the world; that import is its own column (``mpi_init_s``). Each rank
is a bare ``python -c``: nothing else is imported before its clock, so the modules
distcache needs from the standard library are on it. Each rank also reports the
import's time, the loading of init's modules (the package loads them on first use),
init's ``Session.phases`` and the prefetch's ``report.seconds``. The sources are
precompiled first (``compileall``), as an installed package is.

Before the first step every file of the set is read once, and before each step the
page cache is flushed (``sync``, untimed), so every step reads the set from memory and
none pays for another's writes. Neither side waits for the disk: the floor's ``cp``
does not flush, and a prefetch returns once its objects are published and verified,
its one flush per rank running on in the background (the process waits for it before
it exits, untimed).
``BENCH_PROFILE_DIR=DIR`` writes each rank's cProfile of its prefetch there
(``rank<r>-<pid>.pstats``), and of its import and init in the rows through init
(``init-n<ranks>-rank<r>.pstats``).

Times of the prefetch rows are barrier to barrier (the maximum over ranks); peak RSS
is per rank. A cold row that does not download every object of the set once, or a warm
row that downloads any, fails the run. Targets: cold 2x2 <= 1.5x the copy floor, warm
(both ways) <= 10x the stat floor on 1 rank and <= 20x on 2x2. Writes
``bench_family.json`` to --out and prints the table.

    python -m scripts.bench_family --out docs/bench [--cubins DIR|WHEEL] [--limit N]

Run it from the repository root, as a module (it starts ranks with the test harness's
process runner).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

# distcache is imported where it is used, not here: the rows through init time
# ``import distcache`` itself, so their ranks must not have imported it yet.
if TYPE_CHECKING:
    from distcache import Artifact

try:
    from tests.support.process import mpirun, run_group
except ModuleNotFoundError as exc:
    if exc.name != "tests":
        raise
    raise SystemExit("run this from the repository root: python -m scripts.bench_family ...") from None

ROOT = Path(__file__).resolve().parents[1]
SIZES = Path(__file__).with_name("family_sizes.json")
WORKER_TIMEOUT_S = 1800.0
TARGETS = {"cold_2x2_vs_copy_floor": 1.5, "warm_1_vs_stat_floor": 10.0,
           "warm_2x2_vs_stat_floor": 20.0, "warm_init_1_vs_stat_floor": 10.0,
           "warm_init_2x2_vs_stat_floor": 20.0}
#: What a rank through init has done before its clock starts, written into the JSON.
INIT_CLOCK = ("per rank, from before `import distcache` until `distcache.init(manifests=[M], "
              "integrations=[])` returns (pool DISTCACHE_POOL per node, DISTCACHE_NODE_ID, "
              "origin DISTCACHE_ORIGIN=<the directory origin>); the maximum over ranks. "
              "Under mpirun, `from mpi4py import MPI` (MPI_Init, the launcher's and "
              "engine's cost) and one barrier of the world come before the clock; "
              "mpi_init_s is that import, reported apart. Nothing else is imported "
              "before the clock (each rank is a bare `python -c`); sources are "
              "precompiled.")


# -- the set ------------------------------------------------------------------------------


def installed_cubins() -> Path | None:
    try:
        import flashinfer_cubin  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Path(flashinfer_cubin.__file__).parent


def extract_wheel(wheel: Path, dest: Path) -> Path:
    if not (dest / ".complete").exists():
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if member.endswith(".cubin"):
                    zf.extract(member, dest)
        (dest / ".complete").write_text(wheel.name)
    return dest


def generate(dest: Path, seed: int) -> Path:
    """A set with flashinfer-cubin's count and size distribution (random bytes)."""
    summary = json.loads(SIZES.read_text())
    if (dest / ".complete").exists():
        return dest
    quantiles: list[int] = summary["quantiles"]
    rng = random.Random(seed)
    steps = len(quantiles) - 1
    for i in range(summary["count"]):
        x = rng.random() * steps
        lo = int(x)
        hi = min(lo + 1, steps)
        size = int(quantiles[lo] + (quantiles[hi] - quantiles[lo]) * (x - lo))
        path = dest / f"gen/{i // 500:03d}/kernel_{i:05d}.cubin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    (dest / ".complete").write_text(f"seed {seed}")
    return dest


def manifest(mirror: Path, work: Path, limit: int | None) -> list[Artifact]:
    """Every ``*.cubin`` under ``mirror`` with its digest (cached under ``work``)."""
    from distcache import Artifact, parse_checksums

    cache = work / "manifest.txt"
    if not cache.exists() or cache.read_text().count("\n") == 0:
        lines = []
        for path in sorted(mirror.rglob("*.cubin")):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            lines.append(f"{digest}  {path.relative_to(mirror).as_posix()}\n")
        cache.write_text("".join(lines))
    arts = parse_checksums(cache.read_text())[:limit]
    return [Artifact(a.name, a.sha256, (mirror / a.name).stat().st_size) for a in arts]


# -- a rank -------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from distcache import Artifact, ArtifactPool, DirOrigin, parse_checksums, prefetch

    if args.ranks_per_node:
        from mpi4py import MPI

        import distcache.comm

        rank = MPI.COMM_WORLD.Get_rank()
        comm = distcache.comm.from_mpi(node_id=f"node{rank // args.ranks_per_node}")
    else:
        import distcache.comm

        comm = distcache.comm.local("node0")
    arts = parse_checksums(args.manifest.read_text())
    sizes = json.loads(args.sizes.read_text())
    arts = [Artifact(a.name, a.sha256, sizes[a.sha256]) for a in arts]
    pool = ArtifactPool(args.pools / comm.node_id)
    origin = DirOrigin(args.mirror)
    comm.allgather_object(comm.rank)
    comm.barrier()
    profile_dir = os.environ.get("BENCH_PROFILE_DIR")
    profiler = None
    if profile_dir:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    report = prefetch(arts, comm=comm, pool=pool, origin=origin)
    comm.barrier()
    if profiler is not None and profile_dir:
        profiler.disable()
        os.makedirs(profile_dir, exist_ok=True)
        profiler.dump_stats(os.path.join(profile_dir, f"rank{comm.rank}-{os.getpid()}.pstats"))
    wall = time.perf_counter() - start
    mine = {"wall_s": wall, "rank": comm.rank, "node": comm.node_id,
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    gathered = comm.allgather_object(mine)
    if comm.rank == 0:
        args.result.write_text(json.dumps({
            "wall_s": max(g["wall_s"] for g in gathered),
            "ranks": gathered,
            "report": {"downloads": report.downloads, "origin_bytes": report.origin_bytes,
                       "broadcasts": report.broadcasts,
                       "received_bytes": report.received_bytes,
                       "objects_published": report.objects_published,
                       "pool_hits": report.pool_hits, "peak_bytes": report.peak_bytes,
                       "seconds": dict(report.seconds)},
        }))


#: One rank of a row through init, run as ``python -c INIT_RANK RANKS_PER_NODE MANIFEST
#: MIRROR POOLS RESULT``. Before its clock it has loaded only what Python loads to start
#: (and, under mpirun, mpi4py): the clock counts every module that ``import distcache``
#: and init load, none of them loaded by this script first. After the clock,
#: :func:`init_rank_report` writes the figures.
INIT_RANK = """
import os, sys, time
began = time.perf_counter()
per_node, manifest, mirror, pools, result = sys.argv[1:6]
per_node = int(per_node)
world, rank = None, 0
if per_node:
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
mpi_init_s = time.perf_counter() - began if world is not None else None
node = f"node{rank // per_node}" if per_node else "node0"
os.environ.update({"DISTCACHE_POOL": os.path.join(pools, node), "DISTCACHE_NODE_ID": node,
                   "DISTCACHE_ORIGIN": mirror})
if any(name == "distcache" or name.startswith("distcache.") for name in sys.modules):
    raise SystemExit("distcache was imported before the clock of a row through init")
if world is not None:
    world.Barrier()
profile_dir = os.environ.get("BENCH_PROFILE_DIR")
profiler = None
if profile_dir:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
start, cpu_start = time.perf_counter(), time.process_time()
import distcache
imported = time.perf_counter()
hook = distcache.init  # the package loads its modules on first use: init's here
resolved = time.perf_counter()
session = hook(manifests=[manifest], integrations=[])
done, cpu_s = time.perf_counter(), time.process_time() - cpu_start
if profiler is not None:
    profiler.disable()
    os.makedirs(profile_dir, exist_ok=True)
    size = 1 if world is None else world.Get_size()
    profiler.dump_stats(os.path.join(profile_dir, f"init-n{size}-rank{rank}.pstats"))
from scripts.bench_family import init_rank_report
init_rank_report(session, result, rank=rank, node=node, mpi_init_s=mpi_init_s,
                 import_s=imported - start, load_init_s=resolved - imported,
                 init_s=done - resolved, cpu_s=cpu_s)
"""


def init_rank_report(session: Any, result: str, *, rank: int, node: str,
                     mpi_init_s: float | None, import_s: float, load_init_s: float,
                     init_s: float, cpu_s: float) -> None:
    """Gather the ranks' figures of a row through init (after the clock); rank 0 writes
    them to ``result``."""
    from distcache._beside import BESIDE

    phases = dict(session.phases)
    report = session.report
    mine = {"rank": rank, "node": node, "mpi_init_s": mpi_init_s, "import_s": import_s,
            "load_init_s": load_init_s, "init_s": init_s,
            "total_s": import_s + load_init_s + init_s,
            # This process's CPU time on the clock: on a machine with fewer cores than
            # ranks, the row is bounded below by the ranks' CPU over the cores.
            "cpu_s": cpu_s, "phases": phases,
            # init's time outside its named phases (settings, the integrations chosen,
            # the peer start-up between pool and prefetch; an install beside the
            # prefetch overlaps it).
            "outside_phases_s": init_s - sum(v for k, v in phases.items()
                                             if not k.endswith(BESIDE)),
            "report_seconds": {} if report is None else dict(report.seconds),
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    gathered = session.comm.allgather_object(mine)
    if rank == 0:
        mpi = [g["mpi_init_s"] for g in gathered if g["mpi_init_s"] is not None]
        Path(result).write_text(json.dumps({
            "wall_s": max(g["total_s"] for g in gathered),
            "mpi_init_s": max(mpi) if mpi else None,
            "clock": INIT_CLOCK,
            "ranks": gathered,
            "report": None if report is None else {
                "downloads": report.downloads, "pool_hits": report.pool_hits,
                "broadcasts": report.broadcasts, "objects_published": report.objects_published,
                "seconds": dict(report.seconds)},
        }))


# -- the driver ---------------------------------------------------------------------------


def run_ranks(args: argparse.Namespace, work: Path, pools: Path, label: str,
              ranks: int, *, through_init: bool = False) -> dict[str, Any]:
    result = work / f"{label}.json"
    result.unlink(missing_ok=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    per_node = 0 if ranks == 1 else 2
    if through_init:
        me = [sys.executable, "-c", INIT_RANK, str(per_node), str(work / "subset.txt"),
              str(args.mirror_dir), str(pools), str(result)]
    else:
        me = [sys.executable, "-m", "scripts.bench_family", "--worker",
              "--ranks-per-node", str(per_node), "--manifest", str(work / "subset.txt"),
              "--sizes", str(work / "sizes.json"), "--mirror", str(args.mirror_dir),
              "--pools", str(pools), "--result", str(result)]
    cmd = me if ranks == 1 else [mpirun(), "-n", str(ranks), "--oversubscribe",
                                 "--bind-to", "none", *me]
    os.sync()  # nothing of an earlier step is still being written back under this one
    done = run_group(cmd, timeout=WORKER_TIMEOUT_S, env=env, cwd=ROOT)
    if done.returncode != 0 or not result.exists():
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"{label} failed with status {done.returncode}")
    figures: dict[str, Any] = json.loads(result.read_text())
    return figures


def timed_shell(command: str) -> float:
    start = time.perf_counter()
    subprocess.run(["bash", "-c", command], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def copy_floor(mirror: Path, arts: list[Artifact], work: Path) -> dict[str, float]:
    """``cp`` of the set (the files listed) + SHA-256 of the copy as distcache hashes
    (OpenSSL's, through ``hashlib``) on as many threads as there are cores: coreutils'
    ``sha256sum`` hashes several times slower here, and a floor made of it would
    flatter the ratios."""
    dest = work / "floor-copy"
    shutil.rmtree(dest, ignore_errors=True)
    listing = work / "floor-list.txt"
    listing.write_bytes(b"\0".join(a.name.encode() for a in arts) + b"\0")
    dest.mkdir()
    q = shlex.quote
    cp_s = timed_shell(f"cd {q(str(mirror))} && xargs -0 cp --parents -t {q(str(dest))} "
                       f"< {q(str(listing))}")
    hash_s = hash_copy(dest, arts)
    shutil.rmtree(dest, ignore_errors=True)
    return {"cp_s": cp_s, "sha256_s": hash_s, "hash_threads": os.cpu_count() or 1,
            "total_s": cp_s + hash_s}


def hash_copy(dest: Path, arts: list[Artifact]) -> float:
    """Seconds to hash every file of the copy (and check it), on one thread a core."""
    from concurrent.futures import ThreadPoolExecutor

    def one(a: Artifact) -> None:
        digest = hashlib.sha256()
        with open(dest / a.name, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != a.sha256:
            raise SystemExit(f"the copy of {a.name} does not match its digest")

    start = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, arts))
    return time.perf_counter() - start


def read_once(mirror: Path, arts: list[Artifact]) -> None:
    """Read every file of the set once, so that all steps find it in the page cache."""
    for a in arts:
        with open(mirror / a.name, "rb") as f:
            while f.read(1 << 20):
                pass


def stat_floor(pool_dir: Path, arts: list[Artifact]) -> float:
    from distcache import ArtifactPool

    layout = ArtifactPool(pool_dir).layout
    paths = [layout.object_path(a.sha256) for a in arts]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for path in paths:
            os.stat(path)
        best = min(best, time.perf_counter() - start)
    return best


def check_downloads(rows: dict[str, Any], objects: int) -> None:
    """A cold row downloads every object of the set once, a warm row none; else the
    row timed something other than what it is named for, and the run fails."""
    wrong = []
    for label in ("cold_1", "cold_2x2", "warm_1", "warm_2x2", "warm_init_1", "warm_init_2x2"):
        report = rows[label]["report"]
        want = objects if label.startswith("cold") else 0
        if report is None:
            wrong.append(f"{label}: no prefetch report (expected {want} downloads)")
        elif report["downloads"] != want:
            wrong.append(f"{label}: {report['downloads']} downloads, expected {want}")
    if wrong:
        raise SystemExit(f"the set has {objects} objects (distinct sha256s); "
                         + "; ".join(wrong))


def driver(args: argparse.Namespace) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-family-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.cubins is not None and args.cubins.suffix == ".whl":
        mirror, source = extract_wheel(args.cubins, work / "wheel"), args.cubins.name
    elif args.cubins is not None:
        wheels = sorted(p.name.removesuffix(".dist-info")
                        for p in args.cubins.glob("flashinfer_cubin-*.dist-info"))
        mirror = args.cubins
        source = f"{wheels[0]} wheel, unpacked" if wheels else "a directory of cubins"
    elif (found := installed_cubins()) is not None:
        mirror, source = found, "flashinfer-cubin (installed)"
    else:
        mirror, source = generate(work / "generated", args.seed), f"generated (seed {args.seed})"
    args.mirror_dir = mirror
    # Real installs have byte code; this environment may not write it on import.
    subprocess.run([sys.executable, "-m", "compileall", "-q", "distcache", "launch"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    from distcache.artifact import manifest_text

    arts = manifest(mirror, work, args.limit)
    (work / "subset.txt").write_text(manifest_text(arts))
    (work / "sizes.json").write_text(json.dumps({a.sha256: a.size for a in arts}))
    total = sum(a.size or 0 for a in arts)
    print(f"{len(arts)} artifacts, {total / 1e9:.2f} GB from {source}; work dir {work}")
    for stale in ("pools1", "pools2x2"):
        shutil.rmtree(work / stale, ignore_errors=True)
    # Every step reads the set from the page cache, as the floor's cp does, and
    # starts with nothing dirty (untimed): no step pays for an earlier one's writes.
    read_once(mirror, arts)
    os.sync()
    rows: dict[str, Any] = {"copy_floor": copy_floor(mirror, arts, work)}
    steps = (("cold_1", "pools1", 1), ("warm_1", "pools1", 1), ("warm_init_1", "pools1", 1),
             ("cold_2x2", "pools2x2", 4), ("warm_2x2", "pools2x2", 4),
             ("warm_init_2x2", "pools2x2", 4))
    for label, pools, ranks in steps:
        os.sync()
        rows[label] = run_ranks(args, work, work / pools, label, ranks,
                                through_init=label.startswith("warm_init"))
        if label == "warm_1":
            rows["stat_floor_s"] = stat_floor(work / "pools1" / "node0", arts)
    check_downloads(rows, len({a.sha256 for a in arts}))
    floor = rows["copy_floor"]["total_s"]
    stat = rows["stat_floor_s"]
    ratios = {
        "cold_1_vs_copy_floor": rows["cold_1"]["wall_s"] / floor,
        "cold_2x2_vs_copy_floor": rows["cold_2x2"]["wall_s"] / floor,
        "warm_1_vs_stat_floor": rows["warm_1"]["wall_s"] / stat,
        "warm_2x2_vs_stat_floor": rows["warm_2x2"]["wall_s"] / stat,
        "warm_init_1_vs_stat_floor": rows["warm_init_1"]["wall_s"] / stat,
        "warm_init_2x2_vs_stat_floor": rows["warm_init_2x2"]["wall_s"] / stat,
    }
    met = {k: ratios[k] <= v for k, v in TARGETS.items()}
    out = {
        "script": "scripts/bench_family.py", "source": source,
        # Paths of this machine stay out of the figures: only their last component.
        "argv": [Path(a).name if os.sep in a else a for a in sys.argv[1:]],
        "artifacts": len(arts), "bytes": total, "machine": platform.platform(),
        "cpus": os.cpu_count(), "rows": rows, "ratios": ratios, "targets": TARGETS,
        "met": met,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_family.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"copy floor (cp + SHA-256): {floor:.2f} s   stat floor: {stat * 1e3:.1f} ms")
    for key in ("cold_1", "warm_1", "warm_init_1", "cold_2x2", "warm_2x2", "warm_init_2x2"):
        row = rows[key]
        rss = max(r["maxrss_bytes"] for r in row["ranks"]) / 1e6
        downloads = row["report"]["downloads"] if row["report"] else 0
        mpi = f"  MPI_Init (apart) {row['mpi_init_s']:.3f} s" if row.get("mpi_init_s") else ""
        print(f"{key:13s} {row['wall_s']:8.3f} s  downloads {downloads:6d}  "
              f"peak RSS/rank {rss:7.1f} MB{mpi}")
    for key in ("warm_init_1", "warm_init_2x2"):
        for r in rows[key]["ranks"]:
            split = " ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
            inner = " ".join(f"{k} {v:.3f}" for k, v in r["report_seconds"].items())
            print(f"  {key} rank {r['rank']}: cpu {r['cpu_s']:.3f}  import "
                  f"{r['import_s']:.3f}  loading init {r['load_init_s']:.3f}  init "
                  f"{r['init_s']:.3f} [{split}; outside phases {r['outside_phases_s']:.3f}] "
                  f"prefetch [{inner}]")
    for key, value in ratios.items():
        target = TARGETS.get(key)
        verdict = "" if target is None else f"  (target <= {target}: {'met' if met[key] else 'MISSED'})"
        print(f"{key:28s} {value:7.2f}x{verdict}")
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cubins", type=Path, help="a directory of cubins or a wheel")
    parser.add_argument("--limit", type=int, help="use the first N artifacts only")
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated set")
    parser.add_argument("--work", type=Path, help="scratch directory (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work dir")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks-per-node", type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("--manifest", "--sizes", "--mirror", "--pools", "--result"):
        parser.add_argument(hidden, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    (worker if args.worker else driver)(args)


if __name__ == "__main__":
    main()
