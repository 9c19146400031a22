#!/usr/bin/env python
"""Compare ways of getting K artifacts onto N ranks, against a loopback origin with
per-request latency and a bandwidth cap.

Strategies:
  every     every rank downloads every artifact into its own cache (FlashInfer's
            behaviour today: N x K origin requests)
  rank0     rank 0 downloads everything, then broadcasts each artifact on its own
  distcache distcache.prefetch: downloads spread over ranks, bucketed broadcast to
            one writer per node-local pool

Runs N ranks as threads of this process (default), or under mpirun with
``--backend mpi``. Prints a table and writes ``bench_prefetch.json`` (figures plus
the measured cost parameters a scale model needs: per-request latency, origin
bandwidth, broadcast latency and per-byte cost) and ``bench_prefetch.png`` to --out.

    python scripts/bench_prefetch.py --ranks 8 --nodes 4 --artifacts 64 --out bench/
    mpirun -n 4 python scripts/bench_prefetch.py --backend mpi --out bench/
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from distcache.artifact import Artifact, parse_checksums
from distcache.collective import prefetch
from distcache.comm.base import Communicator
from distcache.origin import HttpOrigin
from distcache.pool import ArtifactPool

STRATEGIES = ("every", "rank0", "distcache")


def every_rank_downloads(
    comm: Communicator, arts: list[Artifact], origin: HttpOrigin, pool: ArtifactPool, threads: int
) -> None:
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda a: pool.put(origin.fetch(a), a.sha256), arts))


def rank0_then_broadcast(
    comm: Communicator, arts: list[Artifact], origin: HttpOrigin, pool: ArtifactPool, threads: int
) -> None:
    blobs: dict[str, bytes] = {}
    if comm.rank == 0:
        with ThreadPoolExecutor(threads) as ex:
            blobs = dict(zip([a.sha256 for a in arts], ex.map(origin.fetch, arts), strict=True))
    for a in arts:
        data = comm.broadcast_bytes(blobs.get(a.sha256), 0)
        if comm.rank != 0:
            pool.put(data, a.sha256)


def with_distcache(
    comm: Communicator, arts: list[Artifact], origin: HttpOrigin, pool: ArtifactPool, threads: int
) -> None:
    prefetch(arts, comm=comm, pool=pool, origin=origin, downloads_per_rank=threads)


RUNNERS: dict[str, Callable[..., None]] = {
    "every": every_rank_downloads,
    "rank0": rank0_then_broadcast,
    "distcache": with_distcache,
}


def measure_origin(origin: HttpOrigin, arts: list[Artifact], reps: int = 5) -> dict[str, float]:
    """Per-request latency (smallest artifact) and bandwidth (largest) of the origin."""
    small = min(arts, key=lambda a: a.size or 0)
    big = max(arts, key=lambda a: a.size or 0)
    lat = []
    for _ in range(reps):
        t = time.perf_counter()
        origin.fetch(small)
        lat.append(time.perf_counter() - t)
    latency = statistics.median(lat)
    t = time.perf_counter()
    size = len(origin.fetch(big))
    seconds = max(time.perf_counter() - t - latency, 1e-9)
    return {"request_latency_s": latency, "origin_bandwidth_Bps": size / seconds}


def measure_broadcast(comm: Communicator, reps: int = 10) -> dict[str, float]:
    """Broadcast cost alpha + beta * bytes, from a 1-byte and a 4 MiB broadcast."""

    def timed(nbytes: int) -> float:
        payload = b"x" * nbytes if comm.rank == 0 else None
        comm.barrier()
        t = time.perf_counter()
        for _ in range(reps):
            comm.broadcast_bytes(payload, 0)
        comm.barrier()
        return (time.perf_counter() - t) / reps

    alpha = timed(1)
    big = 4 << 20
    beta = max(timed(big) - alpha, 0.0) / big
    return {"bcast_alpha_s": alpha, "bcast_beta_s_per_byte": beta}


def run_rank(
    comm: Communicator,
    args: argparse.Namespace,
    workdir: Path,
    url: str,
    arts: list[Artifact],
    strategy: str,
) -> float:
    # Simulated nodes (one pool each), so that one machine shows the multi-node case.
    node = comm.rank * min(args.nodes, comm.size) // comm.size
    if strategy == "every":
        root = workdir / strategy / f"rank{comm.rank}"  # private per-rank cache
    else:
        root = workdir / strategy / f"node{node}"
    pool = ArtifactPool(root)
    origin = HttpOrigin(url, retries=0)
    comm.barrier()
    t = time.perf_counter()
    RUNNERS[strategy](comm, arts, origin, pool, args.downloads_per_rank)
    comm.barrier()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("threads", "mpi"), default="threads")
    parser.add_argument("--ranks", type=int, default=8, help="thread-ranks (threads backend)")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (one pool each)")
    parser.add_argument("--artifacts", type=int, default=64)
    parser.add_argument("--min-size", type=int, default=50_000)
    parser.add_argument("--max-size", type=int, default=600_000)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds per origin request")
    parser.add_argument("--bandwidth", type=float, default=100e6, help="origin bytes/s, total")
    parser.add_argument("--downloads-per-rank", type=int, default=4)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]

    if args.backend == "mpi":
        from distcache.comm import from_mpi

        world = from_mpi()
        comms: list[Communicator] = [world]
        size = world.size
    else:
        from distcache.comm import ThreadGroup

        size = args.ranks
        group = ThreadGroup(size, [f"node{r * args.nodes // size}" for r in range(size)])
        comms = [group.comm(r) for r in range(size)]
    lead = comms[0]

    server = None
    workdir = Path(tempfile.mkdtemp(prefix="bench-prefetch-")) if lead.rank == 0 else Path()
    if lead.rank == 0:
        from distcache.testing import LoopbackOrigin, make_artifacts

        make_artifacts(
            workdir / "mirror", args.artifacts, min_size=args.min_size, max_size=args.max_size
        )
        server = LoopbackOrigin(workdir / "mirror", latency=args.latency, bandwidth=args.bandwidth)
    if args.backend == "mpi":
        shared = lead.broadcast_bytes(
            f"{workdir}\n{server.url if server else ''}".encode() if lead.rank == 0 else None, 0
        ).decode()
        workdir, url = Path(shared.split("\n")[0]), shared.split("\n")[1]
    else:
        assert server is not None
        url = server.url
    arts = [a for a in parse_checksums((workdir / "mirror" / "checksums.txt").read_text())]
    sizes = {
        p.relative_to(workdir / "mirror").as_posix(): p.stat().st_size
        for p in (workdir / "mirror").rglob("*.cubin")
    }
    arts = [Artifact(a.name, a.sha256, sizes.get(a.name)) for a in arts]
    total_bytes = sum(a.size or 0 for a in arts)

    params: dict[str, float] = {}
    if lead.rank == 0:
        params.update(measure_origin(HttpOrigin(url, retries=0), arts))

    def on_all(fn: Callable[[Communicator], Any]) -> list[Any]:
        if args.backend == "mpi":
            return [fn(lead)]
        out: list[Any] = [None] * size
        threads = [
            threading.Thread(target=lambda r=r: out.__setitem__(r, fn(comms[r])))
            for r in range(size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    params.update(on_all(measure_broadcast)[0])
    rows = []
    for strategy in strategies:
        if server is not None:
            server.reset()
        on_all(lambda c: c.barrier())

        def one(c: Communicator, s: str = strategy) -> float:
            return run_rank(c, args, workdir, url, arts, s)

        seconds = max(on_all(one))
        if args.backend == "mpi":
            seconds = max(lead.allgather_object(seconds))
        if server is not None:
            stats = server.stats()
            rows.append(
                {
                    "strategy": strategy,
                    "origin_requests": stats["total_requests"],
                    "origin_bytes": stats["bytes_sent"],
                    "wall_seconds": seconds,
                }
            )

    if lead.rank == 0:
        assert server is not None
        server.stop()
        write_results(args, size, total_bytes, params, rows)


def write_results(
    args: argparse.Namespace,
    size: int,
    total_bytes: int,
    params: dict[str, float],
    rows: list[dict[str, Any]],
) -> None:
    print(
        f"{size} ranks, {args.artifacts} artifacts ({total_bytes / 1e6:.1f} MB), "
        f"latency {args.latency:g} s/request, bandwidth {args.bandwidth / 1e6:g} MB/s"
    )
    print(f"{'strategy':<10} {'requests':>9} {'origin MB':>10} {'wall s':>8}")
    for row in rows:
        print(
            f"{row['strategy']:<10} {row['origin_requests']:>9} "
            f"{row['origin_bytes'] / 1e6:>10.1f} {row['wall_seconds']:>8.2f}"
        )
    print("measured: " + ", ".join(f"{k}={v:.3g}" for k, v in params.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {
            "backend": args.backend,
            "ranks": size,
            "nodes": args.nodes,
            "artifacts": args.artifacts,
            "artifact_bytes": total_bytes,
            "injected_latency_s": args.latency,
            "bandwidth_cap_Bps": args.bandwidth,
            "downloads_per_rank": args.downloads_per_rank,
        },
        "measured": params,
        "results": rows,
    }
    (args.out / "bench_prefetch.json").write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["strategy"] for r in rows]
    left.bar(names, [r["wall_seconds"] for r in rows], color="tab:blue")
    left.set_ylabel("wall seconds")
    right.bar(names, [r["origin_requests"] for r in rows], color="tab:orange")
    right.set_ylabel("origin requests")
    fig.suptitle(f"{size} ranks, {args.artifacts} artifacts, {args.latency:g} s/request")
    fig.tight_layout()
    fig.savefig(args.out / "bench_prefetch.png", dpi=100)
    print(f"wrote {args.out / 'bench_prefetch.json'} and {args.out / 'bench_prefetch.png'}")


if __name__ == "__main__":
    main()
