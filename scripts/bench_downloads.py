#!/usr/bin/env python
"""What the per-job download cap (``DISTCACHE_DOWNLOADS_PER_JOB``) buys, measured: a
cold prefetch against a loopback HTTP origin with a per-request latency and a total
bandwidth cap, at caps of 4 to 256 concurrent downloads, for two sets:

  engine   64 artifacts of 50-600 KB: the kernels of one engine start-up
  family   1,024 artifacts of 8-240 KB: a slice of a kernel family (the whole
           flashinfer-cubin family has 15,970, 118 KB on average)

Each cell is the median of ``--reps`` runs (3), taken in rotating order, each one
process (``LocalCommunicator``) with ``downloads_per_rank`` and
``downloads_per_job`` both set to the cap: the concurrency a job of any size gets
under that cap, since the cap bounds the whole job's downloads. Next to each time:
the physical floor at that concurrency (ceil(K / cap) x latency + bytes / bandwidth)
and the request rate the origin sees at most (cap / latency).

The default is the smallest cap within 1.1x of the best time over all caps on both
sets: more concurrency buys no time there, and the origin sees no more than
cap / latency requests per second from the whole job.

    python -m scripts.bench_downloads --out docs/bench

Writes ``bench_downloads.json`` to --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from distcache import ArtifactPool, HttpOrigin, parse_checksums, prefetch
from distcache.artifact import Artifact
from distcache.comm import LocalCommunicator
from distcache.testing import LoopbackOrigin, make_artifacts

CAPS = (4, 8, 16, 32, 64, 128, 256)
SETS = {"engine": (64, 50_000, 600_000), "family": (1024, 8_000, 240_000)}
WITHIN = 1.1


def load(mirror: Path) -> list[Artifact]:
    arts = parse_checksums((mirror / "checksums.txt").read_text())
    return [Artifact(a.name, a.sha256, (mirror / a.name).stat().st_size) for a in arts]


def cell(arts: list[Artifact], url: str, cap: int, work: Path) -> float:
    pool_dir = work / f"pool-{cap}"
    shutil.rmtree(pool_dir, ignore_errors=True)
    pool = ArtifactPool(pool_dir)
    with HttpOrigin(url, retries=0) as origin:
        start = time.perf_counter()
        report = prefetch(arts, comm=LocalCommunicator(), pool=pool, origin=origin,
                          downloads_per_rank=cap, downloads_per_job=cap)
        wall = time.perf_counter() - start
    if report.downloads != len(arts):
        raise SystemExit(f"cap {cap}: {report.downloads} downloads, expected {len(arts)}")
    shutil.rmtree(pool_dir, ignore_errors=True)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.1, help="seconds per request")
    parser.add_argument("--bandwidth", type=float, default=200e6, help="origin bytes/s")
    parser.add_argument("--reps", type=int, default=3, help="runs per cell (median)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-downloads-"))
    rows: list[dict[str, Any]] = []
    try:
        for label, (count, low, high) in SETS.items():
            mirror = work / label
            make_artifacts(mirror, count, min_size=low, max_size=high, seed=11)
            arts = load(mirror)
            total = sum(a.size or 0 for a in arts)
            with LoopbackOrigin(mirror, latency=args.latency, bandwidth=args.bandwidth) as server:
                walls: dict[int, list[float]] = {cap: [] for cap in CAPS}
                counts: set[int] = set()
                for rep in range(args.reps):
                    # Rotate the order, so that drift on a busy machine hits every cap.
                    for cap in CAPS[rep % len(CAPS):] + CAPS[:rep % len(CAPS)]:
                        server.reset()
                        walls[cap].append(cell(arts, server.url, cap, work))
                        counts.add(server.total_requests)
                if counts != {count}:
                    raise SystemExit(f"{label}: origin requests per run {counts}, not {count}")
                for cap in CAPS:
                    wall, requests = statistics.median(walls[cap]), count
                    floor = math.ceil(count / cap) * args.latency + total / args.bandwidth
                    rows.append({"set": label, "artifacts": count, "bytes": total, "cap": cap,
                                 "wall_s": wall, "runs_s": walls[cap], "floor_s": floor, "vs_floor": wall / floor,
                                 "origin_requests": requests,
                                 "peak_requests_per_s": cap / args.latency})
                    print(f"{label:7s} K={count:5d} cap {cap:4d}: {wall:7.3f} s  floor "
                          f"{floor:6.3f} s ({wall / floor:5.2f}x)  requests {requests:5d}  "
                          f"at most {cap / args.latency:6.0f}/s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = {label: min(r["wall_s"] for r in rows if r["set"] == label) for label in SETS}
    near = [{r["cap"] for r in rows if r["set"] == label and r["wall_s"] <= WITHIN * best[label]}
            for label in SETS]
    chosen = min(set.intersection(*near), default=None)
    print("best: " + ", ".join(f"{label} {s:.3f} s" for label, s in best.items())
          + f"; smallest cap within {WITHIN}x of the best on every set: {chosen}")
    out = {"script": "scripts/bench_downloads.py", "latency_s": args.latency,
           "bandwidth_Bps": args.bandwidth, "machine": platform.platform(),
           "cpus": os.cpu_count(), "reps": args.reps, "rows": rows, "within": WITHIN,
           "best_s": best, "chosen_cap": chosen}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_downloads.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out / 'bench_downloads.json'}")


if __name__ == "__main__":
    main()
