#!/usr/bin/env python3
"""Hit-path throughput of ArtifactPool.get against reading a FlashInfer-style tree.

Both sides read every file and SHA-256 it (the pool's verification; the direct read
hashes the same bytes, as FlashInfer's loader does when it checks a cubin), with the
files hot in the page cache. The pool is expected to stay within 1.2x of the direct
read.

    python scripts/bench_pool.py [--count 1000] [--rounds 5] [--out bench-results]

Prints a table and writes ``bench_pool.json`` (and ``bench_pool.png`` when matplotlib
is installed) under ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from distcache import Artifact, ArtifactPool
from distcache.testing import make_artifacts


def direct_read(paths: list[tuple[Path, str]]) -> int:
    total = 0
    for path, digest in paths:
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"direct read of {path} does not verify")
        total += len(data)
    return total


def pool_read(pool: ArtifactPool, artifacts: list[Artifact]) -> int:
    total = 0
    get = pool.get
    for artifact in artifacts:
        data = get(artifact.sha256)
        if data is None:
            raise SystemExit(f"pool miss for {artifact.name}")
        total += len(data)
    return total


def measure(fn: Callable[[], int], rounds: int) -> tuple[float, int]:
    fn()  # warm the page cache and the code path
    times = []
    nbytes = 0
    for _ in range(rounds):
        start = time.perf_counter()
        nbytes = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), nbytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to build the tree and pool (default: a temp dir)")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-pool-", dir=args.workdir))
    try:
        artifacts = make_artifacts(work / "tree", args.count, seed=args.seed)
        paths = [(work / "tree" / a.name, a.sha256) for a in artifacts]
        pool = ArtifactPool(work / "pool", max_bytes=None)
        for path, digest in paths:
            pool.put(path.read_bytes(), digest)

        rows: list[dict[str, object]] = []

        def record(label: str, seconds: float, nbytes: int) -> None:
            rows.append({
                "path": label,
                "seconds": seconds,
                "objects_per_s": len(artifacts) / seconds,
                "mb_per_s": nbytes / seconds / 1e6,
            })

        direct_s, direct_bytes = measure(lambda: direct_read(paths), args.rounds)
        record("direct read + sha256", direct_s, direct_bytes)
        pool_s, pool_bytes = measure(lambda: pool_read(pool, artifacts), args.rounds)
        record("pool.get (verified)", pool_s, pool_bytes)
        # Worst case for the recency stamp: every read rewrites the object's mtime.
        pool.stamp_interval = -1.0
        stamp_s, stamp_bytes = measure(lambda: pool_read(pool, artifacts), args.rounds)
        record("pool.get, stamp every read", stamp_s, stamp_bytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ratio = pool_s / direct_s
    print(f"{len(artifacts)} artifacts, {direct_bytes / 1e6:.1f} MB, median of {args.rounds} rounds")
    print(f"{'path':<30} {'seconds':>9} {'objects/s':>11} {'MB/s':>9}")
    for row in rows:
        print(f"{row['path']:<30} {row['seconds']:>9.4f} {row['objects_per_s']:>11.0f} "
              f"{row['mb_per_s']:>9.1f}")
    print(f"pool.get / direct read time ratio: {ratio:.3f} (target <= 1.2)")
    print(f"with a stamp on every read:        {stamp_s / direct_s:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "count": len(artifacts),
        "bytes": direct_bytes,
        "rounds": args.rounds,
        "seed": args.seed,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "rows": rows,
        "ratio_pool_over_direct": ratio,
        "ratio_stamp_every_read": stamp_s / direct_s,
    }
    (args.out / "bench_pool.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; skipped the chart")
    else:
        fig, ax = plt.subplots(figsize=(6, 3))
        labels = [str(r["path"]) for r in rows]
        values = [float(r["mb_per_s"]) for r in rows]  # type: ignore[arg-type]
        ax.barh(labels, values, color=["#888888", "#2a7ab0", "#7fb3d5"])
        ax.set_xlabel("MB/s (read + SHA-256, page cache hot)")
        ax.set_title(f"{len(artifacts)} cubin-sized artifacts; pool/direct = {ratio:.2f}x")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(args.out / "bench_pool.png", dpi=120)
        plt.close(fig)
    print(f"wrote {args.out / 'bench_pool.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
