#!/usr/bin/env python
"""First-call time of a model under ``torch.compile`` on CPU, per rank, with Inductor's
cache cold, warm from a local cache, and warm on a fresh node through distcache.

Shape: one MPMD ``mpirun`` launch per scenario, 2 simulated nodes x 2 ranks
(``DISTCACHE_NODE_ID`` per node), a pool per node and a ``TORCHINDUCTOR_CACHE_DIR``
per node, every rank calling ``distcache.init(jit_caches=["inductor"])`` before it
compiles a two-block transformer (``--dim``, ``--layers``).

  cold         empty cache directories and pools: every rank compiles (the baseline);
               then ``session.sync()`` publishes what each node built
  warm local   the same directories again: Inductor's own cache, nothing to fill
  fresh node   node B's cache directory and pool removed: node B's directory is
               filled at ``init`` from node A's pool (moved over the communicator)

The first call is timed on each rank from just before the compiled model is called
to its return; ``init`` (which includes the fill) is reported beside it. Each rank
also reports Inductor's ``fxgraph_cache_hit``/``miss`` counters, so a warm figure
that was not a hit shows up as one. The three scenarios run ``--repeat`` times
(default 3), each time in fresh directories; each cell is the median of the runs, and
the hit and miss counts of every run are listed. Target: fresh node <= 1.5x warm local
(medians of node B's ranks, init + first call). Each run launches the scenarios in the
same order, so a first call that drops from warm local to fresh node on node A too (its
directories are the same in both) cannot be credited to the fill. JSON goes to ``--out``
(default ``docs/bench/jit.json``).

Run it from the repository root, as a module (``python -m scripts.bench_jit``): it
starts its ranks with the test harness's process runner (:mod:`tests.support.process`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:
    from tests.support.process import mpirun, run_group
except ModuleNotFoundError as exc:
    if exc.name != "tests":
        raise
    raise SystemExit("run this from the repository root: python -m scripts.bench_jit") from None

REPO = Path(__file__).resolve().parents[1]
NODES = ("a", "b")
RANKS_PER_NODE = 2


def worker(dim: int, layers: int, sync: bool) -> None:
    """One rank: init, compile, call once, report (and sync after the cold launch)."""
    import distcache
    from distcache.jit import Family

    started = time.perf_counter()
    session = distcache.init(integrations=(), jit_caches=["inductor"])
    init_s = time.perf_counter() - started
    import torch
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    block = [torch.nn.TransformerEncoderLayer(dim, 4, dim * 2, dropout=0.0, batch_first=True)
             for _ in range(layers)]
    model = torch.nn.Sequential(*block).eval()
    compiled = torch.compile(model)
    x = torch.randn(2, 16, dim)
    begin = time.perf_counter()
    with torch.no_grad():
        compiled(x)
    first_call_s = time.perf_counter() - begin
    sync_s = None
    if sync:
        begin = time.perf_counter()
        session.sync()
        sync_s = time.perf_counter() - begin
    fams = [i for i in session.integrations if isinstance(i, Family)]
    print(json.dumps({
        "rank": session.comm.rank, "node": session.comm.node_id, "init_s": init_s,
        "first_call_s": first_call_s, "sync_s": sync_s,
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "filled_files": sum(f.report.placed.written for f in fams),
        "filled_bytes": sum(f.report.placed.bytes for f in fams),
    }), flush=True)
    session.close()


def launch(work: Path, args: argparse.Namespace, sync: bool) -> list[dict[str, Any]]:
    cmd = [mpirun(), "--oversubscribe"]
    for index, node in enumerate(NODES):
        if index:
            cmd.append(":")
        cmd += ["-n", str(RANKS_PER_NODE)]
        env = {"DISTCACHE_NODE_ID": node, "DISTCACHE_POOL": str(work / f"pool-{node}"),
               "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{node}"),
               "OMP_NUM_THREADS": "1"}
        for key, value in env.items():
            cmd += ["-x", f"{key}={value}"]
        cmd += [sys.executable, "-m", "scripts.bench_jit", "--worker", "--dim", str(args.dim),
                "--layers", str(args.layers), *(["--sync"] if sync else [])]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                          if p))
    for var in ("DISTCACHE_JIT_CACHES", "DISTCACHE_DISABLE", "DISTCACHE_ORIGIN"):
        env.pop(var, None)
    done = run_group(cmd, timeout=args.timeout, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    return sorted(records, key=lambda r: r["rank"])


SCENARIOS = ("cold", "warm local", "fresh node")


def run_once(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The three scenarios, in order, in a fresh temporary directory."""
    scenarios: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-jit-") as tmp:
        work = Path(tmp)
        scenarios["cold"] = launch(work, args, sync=True)
        scenarios["warm local"] = launch(work, args, sync=False)
        shutil.rmtree(work / "inductor-b")
        shutil.rmtree(work / "pool-b")
        scenarios["fresh node"] = launch(work, args, sync=False)
    return scenarios


def cells(runs: list[dict[str, list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    """Per scenario and rank, the median over the runs of each time, and the counts
    of every run."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name in SCENARIOS:
        ranks = []
        for rank in range(len(NODES) * RANKS_PER_NODE):
            seen = [next(r for r in run[name] if r["rank"] == rank) for run in runs]
            ranks.append({
                "rank": rank, "node": seen[0]["node"],
                **{f: statistics.median(r[f] for r in seen)
                   for f in ("first_call_s", "init_s")},
                "init_plus_first_call_s": statistics.median(
                    r["init_s"] + r["first_call_s"] for r in seen),
                **{f: [r[f] for r in seen] for f in ("hit", "miss", "filled_files")},
            })
        out[name] = ranks
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of the three scenarios; each cell is their median "
                             "(default 3)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one launch may take before its process group is killed")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "jit.json")
    args = parser.parse_args()
    if args.worker:
        worker(args.dim, args.layers, args.sync)
        return
    load_before = os.getloadavg()[0]
    runs = [run_once(args) for _ in range(args.repeat)]
    load_after = os.getloadavg()[0]
    table = cells(runs)

    def median_b(name: str, field: str) -> float:
        return statistics.median(r[field] for r in table[name] if r["node"] == "b")

    ratio = median_b("fresh node", "first_call_s") / median_b("warm local", "first_call_s")
    total = (median_b("fresh node", "init_plus_first_call_s")
             / median_b("warm local", "init_plus_first_call_s"))
    result = {
        "model": f"{args.layers}-block transformer, width {args.dim}, torch.compile on CPU",
        "shape": f"{len(NODES)} nodes x {RANKS_PER_NODE} ranks, a pool and an Inductor "
                 "cache directory per node",
        "cpus": os.cpu_count(),
        # The runs share the machine with whatever else runs there: its 1-minute load
        # average before the first launch and after the last.
        "load_average": [load_before, load_after],
        "repeat": args.repeat,
        "cells": table,
        "runs": runs,
        "fresh_over_warm_local_node_b": ratio,
        "fresh_over_warm_local_node_b_with_init": total,
        "target_fresh_over_warm_local": 1.5,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['model']}; {result['shape']}; {result['cpus']} CPUs, load average "
          f"{load_before:.1f} before, {load_after:.1f} after; medians of {args.repeat} "
          "run(s)\n")
    print("| scenario | node | first call per rank (s) | init per rank (s) | "
          "init + first call, median (s) | files filled | fxgraph hit / miss |")
    print("|---|---|---|---|---|---|---|")
    for name in SCENARIOS:
        for node in NODES:
            mine = [r for r in table[name] if r["node"] == node]
            calls = " ".join(f"{r['first_call_s']:.2f}" for r in mine)
            inits = " ".join(f"{r['init_s']:.2f}" for r in mine)
            both = statistics.median(r["init_plus_first_call_s"] for r in mine)
            filled = "/".join(str(sum(r["filled_files"][i] for r in mine))
                              for i in range(args.repeat))
            hits = "/".join(f"{sum(r['hit'][i] for r in mine)}:{sum(r['miss'][i] for r in mine)}"
                            for i in range(args.repeat))
            print(f"| {name} | {node} | {calls} | {inits} | {both:.2f} | {filled} | {hits} |")
    control = (statistics.median(r["first_call_s"] for r in table["fresh node"]
                                 if r["node"] == "a")
               / statistics.median(r["first_call_s"] for r in table["warm local"]
                                   if r["node"] == "a"))
    # Node A's directories are the same in both scenarios: its first-call ratio is the
    # control (the scenarios run in a fixed order), so node B's is not a speed-up.
    print(f"\nfresh node / warm local (node B, medians): init + first call {total:.2f}x "
          f"(target <= 1.5x); first call {ratio:.2f}x, node A (the control, unchanged "
          f"directories) {control:.2f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
