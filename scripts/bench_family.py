#!/usr/bin/env python
"""A whole kernel family through distcache, next to the floors measured in the same run.

The set is the ``flashinfer-cubin`` package's cubins when it is installed, or
``--cubins DIR|WHEEL`` (a directory, or a wheel whose cubins are extracted under
--work), else a generated set with the same count and size distribution
(``scripts/family_sizes.json``, quantiles of flashinfer-cubin 0.6.13: 15,970 cubins,
1.89 GB). It is served from a directory origin (what ``DISTCACHE_ORIGIN=<dir>`` gives).

Measured, in this order, each in fresh processes:

  copy floor   ``cp -r`` of the set + ``sha256sum`` of the copy (one copy, one hash)
  cold 1       ``distcache.prefetch`` on 1 rank into an empty pool
  warm 1       the same again, the pool full
  stat floor   one ``os.stat`` per object of that pool
  cold 2x2     ``mpirun -n 4``: 2 simulated nodes x 2 ranks, one pool per node
               (``DISTCACHE_NODE_ID`` per rank), each object fetched once per job and
               broadcast to the other node
  warm 2x2     the same again

Before the first step every file of the set is read once, and before each step the
page cache is flushed (``sync``, untimed), so every step reads the set from memory and
none pays for another's writes. Neither side waits for the disk: the floor's ``cp``
does not flush, and a prefetch returns once its objects are published and verified,
its one flush per rank running on in the background (the process waits for it before
it exits, untimed).
``BENCH_PROFILE_DIR=DIR`` writes each rank's cProfile of its prefetch there.

Times are barrier to barrier (the maximum over ranks); peak RSS is per rank. Targets:
cold 2x2 <= 1.5x the copy floor, warm <= 10x the stat floor on 1 rank and <= 20x on
2x2. Writes ``bench_family.json`` to --out and prints the table.

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
from typing import Any

from distcache import Artifact, ArtifactPool, DirOrigin, parse_checksums, prefetch
from distcache.artifact import manifest_text

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
           "warm_2x2_vs_stat_floor": 20.0}


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
    if profiler is not None:
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


# -- the driver ---------------------------------------------------------------------------


def run_ranks(args: argparse.Namespace, work: Path, pools: Path, label: str,
              ranks: int) -> dict[str, Any]:
    result = work / f"{label}.json"
    result.unlink(missing_ok=True)
    common = ["--manifest", str(work / "subset.txt"), "--sizes", str(work / "sizes.json"),
              "--mirror", str(args.mirror_dir), "--pools", str(pools), "--result", str(result)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    me = [sys.executable, "-m", "scripts.bench_family", "--worker"]
    if ranks == 1:
        cmd = [*me, *common]
    else:
        cmd = [mpirun(), "-n", str(ranks), "--oversubscribe", "--bind-to", "none",
               *me, "--ranks-per-node", "2", *common]
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
    """``cp`` of the set (the files listed) + ``sha256sum`` of the copy."""
    dest = work / "floor-copy"
    shutil.rmtree(dest, ignore_errors=True)
    listing = work / "floor-list.txt"
    listing.write_bytes(b"\0".join(a.name.encode() for a in arts) + b"\0")
    dest.mkdir()
    q = shlex.quote
    cp_s = timed_shell(f"cd {q(str(mirror))} && xargs -0 cp --parents -t {q(str(dest))} "
                       f"< {q(str(listing))}")
    hash_s = timed_shell(f"cd {q(str(dest))} && xargs -0 sha256sum < {q(str(listing))}")
    shutil.rmtree(dest, ignore_errors=True)
    return {"cp_s": cp_s, "sha256sum_s": hash_s, "total_s": cp_s + hash_s}


def read_once(mirror: Path, arts: list[Artifact]) -> None:
    """Read every file of the set once, so that all steps find it in the page cache."""
    for a in arts:
        with open(mirror / a.name, "rb") as f:
            while f.read(1 << 20):
                pass


def stat_floor(pool_dir: Path, arts: list[Artifact]) -> float:
    layout = ArtifactPool(pool_dir).layout
    paths = [layout.object_path(a.sha256) for a in arts]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for path in paths:
            os.stat(path)
        best = min(best, time.perf_counter() - start)
    return best


def driver(args: argparse.Namespace) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-family-"))
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
    for label, pools, ranks in (("cold_1", "pools1", 1), ("warm_1", "pools1", 1),
                                ("cold_2x2", "pools2x2", 4), ("warm_2x2", "pools2x2", 4)):
        os.sync()
        rows[label] = run_ranks(args, work, work / pools, label, ranks)
        if label == "warm_1":
            rows["stat_floor_s"] = stat_floor(work / "pools1" / "node0", arts)
    floor = rows["copy_floor"]["total_s"]
    stat = rows["stat_floor_s"]
    ratios = {
        "cold_1_vs_copy_floor": rows["cold_1"]["wall_s"] / floor,
        "cold_2x2_vs_copy_floor": rows["cold_2x2"]["wall_s"] / floor,
        "warm_1_vs_stat_floor": rows["warm_1"]["wall_s"] / stat,
        "warm_2x2_vs_stat_floor": rows["warm_2x2"]["wall_s"] / stat,
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
    print(f"copy floor (cp + sha256sum): {floor:.2f} s   stat floor: {stat * 1e3:.1f} ms")
    for key in ("cold_1", "warm_1", "cold_2x2", "warm_2x2"):
        rss = max(r["maxrss_bytes"] for r in rows[key]["ranks"]) / 1e6
        print(f"{key:9s} {rows[key]['wall_s']:8.3f} s  downloads "
              f"{rows[key]['report']['downloads']:6d}  peak RSS/rank {rss:7.1f} MB")
    for key, value in ratios.items():
        target = TARGETS.get(key)
        verdict = "" if target is None else f"  (target <= {target}: {'met' if met[key] else 'MISSED'})"
        print(f"{key:24s} {value:7.2f}x{verdict}")
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
