"""Start-up through the public hook at N ranks, next to the floor of an MPI program.

    python -m scripts.bench_scale --ranks 16,64 [--repeat 3] [--out docs/bench]

For each N, ``mpirun -n N`` launches of three kinds with 8 ranks per simulated node
(``DISTCACHE_NODE_ID=node<rank // 8>``) and one pool per node, floor and init
alternating ``--repeat`` times each, then one traffic launch:

* **floor**: Python starts, imports mpi4py, ``COMM_WORLD.Dup()``, imports distcache,
  one all-gather: what any MPI program that imports distcache pays;
* **init**: Python starts, imports mpi4py (MPI_Init, as in the floor), then the public
  hook as a user calls it: ``import distcache``,
  ``distcache.init(manifests=[M], integrations=[])`` (FlashInfer's integration, when
  importable, would import torch: the engine's cost, not distcache's), which adopts
  its own duplicate of the MPI world; 64 cubins from a loopback origin answering each
  request after 50 ms, cold node-local pools;
* **traffic**: the same init on fresh cold pools, handed a counting communicator over
  ``distcache.comm.from_mpi()`` so that each rank's bytes sent and received are
  measured; not timed (counting re-encodes every payload).

Each rank reports when it left MPI_Init and when it finished (wall clock, against the
moment the driver launched ``mpirun``), its CPU seconds (loading distcache's modules
apart from the rest) and its peak RSS. A row gives the slowest rank's time of the
median floor and the median init launch (every launch's is listed too), the largest
peak RSS of any init launch against the smallest floor's, the origin's requests in
the init launches (the same in each and one per cubin, or the benchmark fails), and
each rank's bytes from the traffic launch.
The cubins are the ``*.cubin`` files of ``--cubins DIR`` (the first 64), else 64
files drawn from flashinfer-cubin's size distribution (``scripts/family_sizes.json``).

Writes ``OUT/scale.json``; the per-rank inputs of the scale model (``scripts/
scale_model.py``) are under ``per_rank`` in each row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = Path(__file__).with_name("family_sizes.json")
PER_NODE = 8
CUBINS = 64
LATENCY_S = 0.05
LAUNCH_TIMEOUT_S = 600.0


# -- a rank ---------------------------------------------------------------------------


def _rank() -> int:
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args: argparse.Namespace) -> None:
    rank = _rank()
    node = rank // PER_NODE
    figures: dict[str, Any] = {"rank": rank, "node": node}
    if args.worker == "floor":
        from mpi4py import MPI

        figures["started_at"] = time.time()  # MPI_Init done
        world = MPI.COMM_WORLD.Dup()
        import distcache

        world.allgather(rank)
        world.Free()
    else:
        os.environ["DISTCACHE_NODE_ID"] = f"node{node}"
        os.environ["DISTCACHE_POOL"] = str(args.run_dir / f"pool-node{node}")
        # MPI_Init first, as in the floor: what follows is distcache's own cost.
        from mpi4py import MPI

        began, cpu_began = time.time(), time.process_time()
        import distcache

        imported = time.time()
        # The attribute loads the hook's modules (distcache's lazy names), as the call
        # below would: timed apart from what init then does.
        hook = distcache.init
        loaded, cpu_loaded = time.time(), time.process_time()
        comm = None
        if args.worker == "traffic":
            from distcache.comm import CountingCommunicator, from_mpi

            comm = CountingCommunicator(from_mpi())
        # No integration: with FlashInfer importable, init's default would import it
        # (and torch), the engine's start-up cost rather than distcache's.
        session = hook(manifests=[str(args.manifest)], comm=comm, integrations=[])
        figures.update(started_at=began, imported_s=imported - began,
                       loaded_s=loaded - imported, load_cpu_s=cpu_loaded - cpu_began,
                       init_s=time.time() - imported,
                       distcache_cpu_s=time.process_time() - cpu_began)
        report = session.report
        figures.update(largest_bucket=0 if report is None else report.peak_bytes,
                       downloads=0 if report is None else report.downloads)
        if comm is not None:
            bulk = comm.traffic.by_op.get("broadcast_bytes", [0, 0])
            figures.update(sent=comm.traffic.sent, received=comm.traffic.received,
                           calls=comm.traffic.calls, control_sent=comm.traffic.sent - bulk[0],
                           control_received=comm.traffic.received - bulk[1])
        if rank == 0 and report is not None:
            figures["report"] = {"seconds": report.seconds, "objects": report.objects,
                                 "downloads": report.downloads,
                                 "broadcast_bytes": report.broadcast_bytes,
                                 "phases": dict(session.phases)}
    figures["done_at"] = time.time()
    figures["cpu_s"] = time.process_time()
    figures["peak_rss"] = _peak_rss_bytes()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    (args.run_dir / f"{args.worker}-rank{rank}.json").write_text(json.dumps(figures))


# -- the driver -----------------------------------------------------------------------


def make_cubins(mirror: Path, given: Path | None) -> str:
    """64 cubins under ``mirror``; returns where they came from."""
    if given is not None:
        for path in sorted(given.rglob("*.cubin"))[:CUBINS]:
            dest = mirror / path.relative_to(given)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
        return f"the first {CUBINS} cubins of {given.name}"
    quantiles: list[int] = json.loads(SIZES.read_text())["quantiles"]
    rng = random.Random(0)
    steps = len(quantiles) - 1
    for i in range(CUBINS):
        x = rng.random() * steps
        lo = int(x)
        hi = min(lo + 1, steps)
        size = int(quantiles[lo] + (quantiles[hi] - quantiles[lo]) * (x - lo))
        dest = mirror / f"gen/kernel_{i:05d}.cubin"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(rng.randbytes(size))
    return f"{CUBINS} files drawn from flashinfer-cubin's size distribution ({SIZES.name})"


def write_manifest(mirror: Path, path: Path) -> int:
    lines, total = [], 0
    for cubin in sorted(mirror.rglob("*.cubin")):
        data = cubin.read_bytes()
        total += len(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {cubin.relative_to(mirror).as_posix()}\n")
    path.write_text("".join(lines))
    return total


def launch(n: int, mode: str, run_dir: Path, extra: list[str], env: dict[str, str]
           ) -> tuple[float, list[dict[str, Any]]]:
    from tests.support.helpers import mpirun, run_group

    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [mpirun(), "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable,
           "-m", "scripts.bench_scale", "--worker", mode, "--run-dir", str(run_dir), *extra]
    os.sync()  # nothing of the launch before is still being written back under this one
    launched = time.time()
    done = run_group(cmd, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=ROOT)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"mpirun -n {n} {mode} failed with status {done.returncode}")
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob(f"{mode}-rank*.json"))]
    if len(ranks) != n:
        raise SystemExit(f"mpirun -n {n} {mode}: {len(ranks)} of {n} ranks reported")
    return launched, ranks


def expected_requests(manifest: Path) -> int:
    """What a cold init must ask the origin: once per distinct cubin of the manifest."""
    return len({line.split()[0] for line in manifest.read_text().splitlines() if line.strip()})


def row(n: int, work: Path, manifest: Path, url: str, server: Any, repeat: int
        ) -> dict[str, Any]:
    from tests.support.helpers import mpi_env

    env = mpi_env(DISTCACHE_ORIGIN=url)
    for var in ("DISTCACHE_POOL", "DISTCACHE_NODE_ID", "DISTCACHE_DISABLE"):
        env.pop(var, None)
    # Floor and init launches alternate, ``repeat`` of each, every init on cold pools
    # of its own: the row is the median of each (MPI_Init alone varies by tens of
    # seconds between launches of hundreds of ranks on a few cores; with an even
    # ``repeat``, the lower of the two middle launches).
    floors: list[tuple[float, list[dict[str, Any]]]] = []
    inits: list[tuple[float, list[dict[str, Any]], int, float]] = []
    for k in range(repeat):
        launched, ranks = launch(n, "floor", work / f"floor-{n}-{k}", [], env)
        floors.append((max(r["done_at"] for r in ranks) - launched, ranks))
        server.reset()
        launched, ranks = launch(n, "init", work / f"init-{n}-{k}",
                                 ["--manifest", str(manifest)], env)
        inits.append((max(r["done_at"] for r in ranks) - launched, ranks,
                      server.total_requests, launched))
    floor_s, floor = sorted(floors, key=lambda f: f[0])[(repeat - 1) // 2]
    init_s, init, requests, launched = sorted(inits, key=lambda i: i[0])[(repeat - 1) // 2]
    peak = max((r for i in inits for r in i[1]), key=lambda r: r["peak_rss"])
    if {i[2] for i in inits} != {requests}:
        raise SystemExit(f"{n} ranks: the init launches asked the origin "
                         f"{[i[2] for i in inits]} times")
    expected = expected_requests(manifest)
    if requests != expected:
        raise SystemExit(f"{n} ranks: every init launch asked the origin {requests} times, "
                         f"not once per cubin ({expected}): a cold init on cold pools "
                         "fetches each cubin exactly once")
    server.reset()
    _, counted = launch(n, "traffic", work / f"traffic-{n}", ["--manifest", str(manifest)],
                        env)
    if server.total_requests != requests:
        raise SystemExit(f"{n} ranks: the counted launch asked the origin "
                         f"{server.total_requests} times, the timed one {requests}")
    mb = 1 << 20
    sent = [r["sent"] for r in counted]
    received = [r["received"] for r in counted]
    control = [r["control_sent"] + r["control_received"] for r in counted]
    rank0 = next(r for r in init if r["rank"] == 0)
    return {
        "ranks": n,
        "nodes": (n + PER_NODE - 1) // PER_NODE,
        "origin_requests": requests,
        "init_slowest_s": round(init_s, 3),
        "floor_s": round(floor_s, 3),
        "init_over_floor": round(init_s / floor_s, 2),
        "init_runs_s": [round(i[0], 3) for i in inits],
        "floor_runs_s": [round(f[0], 3) for f in floors],
        # Memory: the largest of every init launch, against the smallest floor.
        "peak_rss_mb": round(peak["peak_rss"] / mb, 1),
        "peak_rss_rank": peak["rank"],
        # The median rank of the median launch.
        "median_rss_mb": round(statistics.median(r["peak_rss"] for r in init) / mb, 1),
        "floor_rss_mb": round(min(max(r["peak_rss"] for r in f[1]) for f in floors) / mb, 1),
        "largest_bucket_mb": round(max(r["largest_bucket"] for i in inits for r in i[1]) / mb,
                                   2),
        "bytes_sent_per_rank": {"max": max(sent), "median": statistics.median(sent)},
        "bytes_received_per_rank": {"max": max(received),
                                    "median": statistics.median(received)},
        # Everything but the artifact buckets (broadcasts): agreement, planning,
        # heartbeats and the report.
        "control_bytes_per_rank": {"max": max(control), "median": statistics.median(control)},
        "rank0_phases_s": rank0.get("report", {}).get("seconds"),
        "rank0_init_phases_s": rank0.get("report", {}).get("phases"),
        # CPU seconds per rank (the whole process, start to report): on a machine with
        # fewer cores than ranks, what the job's wall time follows.
        # ``distcache``: from after ``import mpi4py`` (MPI_Init) to init's return.
        "cpu_s_per_rank": {
            "init_median": round(statistics.median(r["cpu_s"] for r in init), 3),
            "floor_median": round(statistics.median(r["cpu_s"] for r in floor), 3),
            "distcache_median": round(statistics.median(r["distcache_cpu_s"] for r in init), 3),
            "distcache_max": round(max(r["distcache_cpu_s"] for r in init), 3),
            # Of distcache's: importing it and loading the hook's modules.
            "load_median": round(statistics.median(r["load_cpu_s"] for r in init), 3),
            # Summed over the ranks of the median launches: what init costs the
            # machine beyond the floor, in core-seconds.
            "init_sum": round(sum(r["cpu_s"] for r in init), 2),
            "floor_sum": round(sum(r["cpu_s"] for r in floor), 2)},
        # When the ranks leave MPI_Init (the spread from first to last) and how long
        # the median launch of each kind runs after the last one has.
        "after_mpi_init_s": {
            kind: {"spread": round(max(r["started_at"] for r in ranks)
                                   - min(r["started_at"] for r in ranks), 3),
                   "last_to_end": round(max(r["done_at"] for r in ranks)
                                        - max(r["started_at"] for r in ranks), 3)}
            for kind, ranks in (("init", init), ("floor", floor))},
        # Each rank's steps (median over ranks): the start of the process (and
        # MPI_Init) to the line before ``import distcache``, the import, loading the
        # hook's modules (``distcache.init``), and ``init`` from the import on (the
        # loading included; it adopts its communicator).
        "init_steps_s": {
            "start": round(statistics.median(r["started_at"] - launched for r in init), 3),
            **{k: round(statistics.median(r[f"{k}_s"] for r in init), 3)
               for k in ("imported", "loaded", "init")}},
        # What the scale model reads per rank: the bytes a rank moves for the
        # collective's control traffic and the memory it holds, at this N.
        "per_rank": {
            "control_bytes_max": max(control),
            "peak_rss_over_floor_mb": round(
                (peak["peak_rss"] - max(r["peak_rss"] for r in floor)) / mb, 1),
            "init_minus_floor_s": round(init_s - floor_s, 3),
            "distcache_cpu_s": round(statistics.median(r["distcache_cpu_s"] for r in init), 3),
        },
    }


def precompile() -> None:
    """Byte-compile the sources, as an installed package is: every rank of both
    launches then loads ``.pyc`` files instead of compiling (this environment may set
    ``PYTHONDONTWRITEBYTECODE``, which stops Python writing them, not reading them)."""
    import compileall

    for package in ("distcache", "launch", "scripts", "tests"):
        compileall.compile_dir(ROOT / package, quiet=1)


def driver(args: argparse.Namespace) -> None:
    from distcache.testing import LoopbackOrigin

    precompile()

    axis = sorted({int(x) for x in args.ranks.split(",") if x})
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    mirror = work / "mirror"
    source = make_cubins(mirror, args.cubins)
    manifest = work / "cubins.txt"
    total = write_manifest(mirror, manifest)
    listed = len(manifest.read_text().splitlines())
    if listed != CUBINS:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"{source}: {listed} cubins, not {CUBINS}")
    rows = []
    load_before = os.getloadavg()[0]
    try:
        with LoopbackOrigin(mirror, latency=LATENCY_S) as server:
            for n in axis:
                rows.append(row(n, work, manifest, server.url, server, args.repeat))
                r = rows[-1]
                print(f"{n:4d} ranks ({r['nodes']} nodes): origin {r['origin_requests']}, "
                      f"init {r['init_slowest_s']:.2f} s vs floor {r['floor_s']:.2f} s "
                      f"({r['init_over_floor']:.2f}x), RSS {r['peak_rss_mb']} MB vs "
                      f"{r['floor_rss_mb']} MB, sent/rank max {r['bytes_sent_per_rank']['max']}"
                      f" B, received/rank max {r['bytes_received_per_rank']['max']} B",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "bench_scale",
        "what": "import distcache; distcache.init(manifests=[M], integrations=[]) under "
                "mpirun, 8 ranks per simulated node, node-local pools, cold; next to the "
                "floor (python, import mpi4py, COMM_WORLD.Dup(), import distcache, one "
                "all-gather); bytes per rank from a third, counted launch",
        "cubins": source,
        "cubin_count": CUBINS,
        "cubin_bytes": total,
        "origin_latency_s": LATENCY_S,
        "ranks_per_node": PER_NODE,
        "repeat": args.repeat,
        "machine": {"cores": os.cpu_count(), "load_before": round(load_before, 2),
                    "load_after": round(os.getloadavg()[0], 2)},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or "scale.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", help="file name under --out (default scale.json)")
    parser.add_argument("--cubins", type=Path, help="a directory of real cubins")
    parser.add_argument("--repeat", type=int, default=3,
                        help="floor and init launches per N (the row takes the median)")
    parser.add_argument("--worker", choices=("floor", "init", "traffic"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--manifest", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.worker is not None:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
