"""Lazy misses across nodes: what the origin and the engine see, three ways.

4 simulated nodes x 2 ranks under MPMD ``mpirun`` (a ``DISTCACHE_NODE_ID``, a pool and,
for FlashInfer alone, a ``FLASHINFER_CUBIN_DIR`` per node), 32 generated artifacts
sized like flashinfer-cubin's cubins (``family_sizes.json``) that no manifest named (nothing is prefetched), the counting loopback origin at
200 ms per request. Warm-up: rank 0 asks for all 32; then every rank asks for all 32
in a burst, through FlashInfer's real ``get_artifact``:

- ``flashinfer``: FlashInfer alone, one cubin directory per node (its own lock and
  re-check dedup within a node);
- ``distcache``: ``distcache.init`` with ``DISTCACHE_PEERS=0``: one pool per node;
- ``distcache_peers``: ``distcache.init`` with the node agents (the default).

Reported: origin requests, per-lookup latency (median, p99) by where the bytes came
from (distcache: the loader's counters around each lookup; FlashInfer alone: whether
its directory had the file), and the burst's wall time per rank. Writes
``docs/bench/lazy.json``.

Run it from the repository root, as a module (``python -m scripts.bench_lazy``): it
starts its ranks with the test harness's process runner (:mod:`tests.support.process`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

NODES = ("node-a", "node-b", "node-c", "node-d")
RANKS_PER_NODE = 2
COUNT = 32
LATENCY_S = 0.2
MODES = ("flashinfer", "distcache", "distcache_peers")
#: Quantiles of the sizes of flashinfer-cubin's 15,970 cubins: the artifacts are drawn
#: uniformly between the 0.5 % and 99.5 % quantiles (50 KB - 251 KB).
SIZES = Path(__file__).with_name("family_sizes.json")
_SOURCES = {"hits": "pool", "local": "local", "peer": "peer", "fetched": "origin",
            "peer_fallbacks": "fallback", "fallbacks": "flashinfer"}


def _worker(mode: str, names: Path) -> None:
    """One rank: warm-up on rank 0, a barrier, the burst on every rank."""
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as loader_module
    pairs = [line.split("  ", 1) for line in names.read_text().splitlines()]
    cubins = Path(os.environ["FLASHINFER_CUBIN_DIR"])
    loader: Any = None
    if mode == "flashinfer":
        from mpi4py import MPI

        barrier = MPI.COMM_WORLD.Barrier
    else:
        import distcache
        from distcache.integrations.flashinfer import FlashInfer, installed

        session = distcache.init(integrations=[FlashInfer()])
        barrier = session.comm.barrier
        loader = installed()

    def ask(sha: str, name: str) -> tuple[float, str]:
        before = dict(vars(loader.stats)) if loader is not None else None
        had = (cubins / name).is_file()
        start = time.perf_counter()
        data = loader_module.get_artifact(name, sha)
        took = time.perf_counter() - start
        assert hashlib.sha256(data).hexdigest() == sha, name
        if before is None:
            return took, "local" if had else "origin"
        after = vars(loader.stats)
        moved = [k for k in _SOURCES if after[k] != before[k]]
        return took, _SOURCES[moved[0]] if moved else "other"

    lookups: list[tuple[str, str, float]] = []
    barrier()
    if rank == 0:
        lookups += [("warmup", src, t) for t, src in (ask(s, n) for s, n in pairs)]
    barrier()
    start = time.perf_counter()
    lookups += [("burst", src, t) for t, src in (ask(s, n) for s, n in pairs)]
    burst = time.perf_counter() - start
    print("RESULT " + json.dumps({"rank": rank, "burst_s": burst, "lookups": lookups}),
          flush=True)
    barrier()
    if loader is not None:
        session.close()


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))]
    return {"n": len(values), "median_ms": round(statistics.median(values) * 1e3, 2),
            "p99_ms": round(p99 * 1e3, 2)}


def _run(mode: str, base: Path) -> dict[str, Any]:
    from distcache.testing import LoopbackOrigin, make_artifacts
    from tests.support.helpers import mpi_env, mpmd_command
    from tests.support.process import run_group

    quantiles = json.loads(SIZES.read_text())["quantiles"]  # flashinfer-cubin's sizes
    made = make_artifacts(base / "repo", COUNT, min_size=quantiles[1], max_size=quantiles[-2])
    names = base / "names.txt"
    names.write_text("".join(f"{a.sha256}  {a.name}\n" for a in made))
    argv = [sys.executable, "-m", "scripts.bench_lazy", "--worker", mode, str(names)]
    with LoopbackOrigin(base / "repo", latency=LATENCY_S) as origin:
        contexts = [(RANKS_PER_NODE, {"DISTCACHE_NODE_ID": node,
                                      "DISTCACHE_POOL": str(base / f"pool-{node}"),
                                      "FLASHINFER_CUBIN_DIR": str(base / f"fi-{node}")}, argv)
                    for node in NODES]
        env = mpi_env(FLASHINFER_CUBINS_REPOSITORY=origin.url, DISTCACHE_HTTP_RETRIES="0",
                      DISTCACHE_PEERS="1" if mode == "distcache_peers" else "0")
        for var in ("DISTCACHE_ORIGIN", "DISTCACHE_AUTOINSTALL", "FLASHINFER_NO_DOWNLOAD"):
            env.pop(var, None)
        done = run_group(mpmd_command(contexts), timeout=300, env=env, cwd=Path.cwd())
        if done.returncode != 0:
            raise SystemExit(f"{mode}: mpirun failed\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        requests = origin.total_requests
    ranks = sorted((json.loads(line[7:]) for line in done.stdout.splitlines()
                    if line.startswith("RESULT ")), key=lambda r: r["rank"])
    by_source: dict[str, list[float]] = {}
    for r in ranks:
        for phase, source, took in r["lookups"]:
            by_source.setdefault(f"{phase}/{source}", []).append(took)
    return {"origin_requests": requests,
            "burst_wall_s": [round(r["burst_s"], 3) for r in ranks],
            "latency": {k: _summary(v) for k, v in sorted(by_source.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "NAMES"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default="docs/bench/lazy.json")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], Path(args.worker[1]))
        return 0
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-lazy-") as tmp:
            results[mode] = _run(mode, Path(tmp))
        r = results[mode]
        print(f"{mode:16} origin requests {r['origin_requests']:4}   burst wall per rank "
              f"{min(r['burst_wall_s']):.2f}-{max(r['burst_wall_s']):.2f} s")
        for source, s in r["latency"].items():
            print(f"    {source:18} n={s['n']:4}  median {s['median_ms']:8.2f} ms  "
                  f"p99 {s['p99_ms']:8.2f} ms")
    report = {"setup": {"nodes": len(NODES), "ranks_per_node": RANKS_PER_NODE,
                        "artifacts": COUNT, "sizes": "uniform 50-251 KB (flashinfer-cubin's 0.5-99.5 % quantiles), generated",
                        "origin_latency_s": LATENCY_S, "prefetched": 0,
                        "machine": f"{os.cpu_count()} CPU cores, loopback TCP"},
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
