#!/usr/bin/env python3
"""The documentation's benchmark figures, rendered from the committed JSON in ``docs/bench/``.

Each block of figures sits between ``<!-- figures:NAME -->`` and
``<!-- /figures:NAME -->`` in one of the pages (README.md and ``docs/*.md``: most in
``docs/benchmarks.md``, the soak's in ``docs/reliability.md``, the JIT caches' in
``docs/jit.md``, the engine check's in ``docs/engines.md``; the start-up at scale in
both README.md and ``docs/benchmarks.md``) and is exactly what :func:`render` makes of
the JSON that the benchmark script wrote (named as the script writes it). A block whose
JSON is not committed yet says so. ``tests/unit/test_readme_figures.py`` checks that every block matches, so a
figure cannot drift from its measurement. After a benchmark run, copy its JSON into
``docs/bench/`` and rewrite the blocks:

    python scripts/readme_figures.py --write
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"


def pages() -> list[Path]:
    """The pages figure blocks may live in: README.md, then ``docs/*.md``."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- figures:(\w+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.DOTALL)


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((BENCH / name).read_text())
    return data


def _s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _n(row: dict[str, Any], key: str, scale: float = 1.0, spec: str = ".0f") -> str:
    """``row[key] / scale`` with thousands separators, or a dash when absent."""
    return "-" if key not in row else f"{row[key] / scale:,{spec}}"


def _targets(targets: list[dict[str, Any]]) -> list[str]:
    return ["Targets, as the script checked them:", "",
            *(f"- {'holds' if t['holds'] else '**fails**'}: {t['target']}: {t['observed']}"
              for t in targets)]


#: ``scripts/bench_prefetch.py``'s warm rows: they download nothing, so they carry no
#: ratio to a download floor.
WARM_ROWS = ("warm", "engine-warm", "engine-init-warm")


def prefetch() -> str:
    d = _load("bench_prefetch.json")
    cfg = d["config"]
    ranks = cfg["ranks"]
    by = {(r["strategy"], r["ranks"]): r for r in d["results"]}
    labels = {"per-rank": "(a) every rank downloads into its own directory",
              "shared-dir": "(b) shared directory, check-download-rename, no coordination",
              "lazy-fetch": "(c) distcache lazy `pool.fetch`",
              "prefetch": "**(d) distcache `prefetch`**",
              "warm": "**(e) distcache `prefetch`, warm (`prefetch()` alone)**",
              "fi-per-rank": "(f) FlashInfer's loader, directory per rank",
              "fi-per-node": "(g) FlashInfer's loader, directory per node",
              "engine": "**(h) prefetch + kernel loads, 2 nodes**",
              "engine-warm": "**(i) prefetch + kernel loads, warm**"}
    axis = " / ".join(str(n) for n in ranks)
    lines = [f"K = {cfg['artifacts']} artifacts ({cfg['artifact_bytes'] / 1e6:.1f} MB), "
             f"{cfg['injected_latency_s'] * 1e3:g} ms per request, "
             f"{cfg['bandwidth_cap_Bps'] / 1e6:g} MB/s origin cap, "
             f"{cfg['downloads_per_rank']} downloads per rank; "
             f"floor = ceil(K / concurrent downloads) x latency + bytes / bandwidth."
             + (f" Each cell is the run with the median wall time of {cfg['repeat']}."
                if cfg.get("repeat", 1) > 1 else ""), "",
             f"| strategy | origin requests (N = {axis}) | wall s (N = {axis}) | "
             f"x floor (N = {axis}) |", "|---|---:|---:|---:|"]
    for strategy, label in labels.items():
        rows = [by.get((strategy, n)) for n in ranks]
        if not any(rows):
            continue
        cell = [("-" if r is None else str(r["origin_requests"])) for r in rows]
        wall = [("-" if r is None else _s(r["wall_s"])) for r in rows]
        # A warm row downloads nothing: no ratio to the download floor.
        ratio = [("-" if r is None or "vs_floor" not in r or strategy in WARM_ROWS
                  else f"{r['vs_floor']:.2f}") for r in rows]
        lines.append(f"| {label} | {' / '.join(cell)} | {' / '.join(wall)} | "
                     f"{' / '.join(ratio)} |")
    baselines = d.get("baselines", [d["baseline"]])
    lines += ["", "| one process fetching the set once | threads | wall s | x floor |",
              "|---|---:|---:|---:|"]
    for b in baselines:
        threads = b.get("concurrent_downloads", cfg["downloads_per_rank"])
        vs_floor = f"{b['vs_floor']:.2f}" if "vs_floor" in b else "-"
        lines.append(f"| baseline | {threads} | {_s(b['wall_s'])} | {vs_floor} |")
    lines += ["", *_targets(d["targets"])]
    return "\n".join(lines) + "\n"


_STRATEGIES = {"every": "every rank (a cubin directory per rank)",
               "per_node": "FlashInfer's default (a directory per node, its lock)",
               "rank0": "rank 0, then a broadcast", "distcache": "distcache"}


def scale() -> str:
    d = _load("scale_model.json")
    p = d["parameters"]
    picks = [n for n in (1, 8, 64, 1024, 4096) if str(n) in d["predictions"]]
    lines = [f"From the measured request latency {p['request_latency_s']:.3f} s, "
             f"per-connection bandwidth {p['origin_bandwidth_Bps'] / 1e6:.0f} MB/s, "
             f"broadcast alpha = {p['bcast_alpha_s'] * 1e6:.0f} us and "
             f"beta = {p['bcast_beta_s_per_byte'] * 1e9:.2f} ns/B per tree hop; "
             f"{int(p['gpus_per_node'])} ranks per node, an origin capped at "
             f"{p['origin_aggregate_Bps'] * 8 / 1e9:g} Gbit/s and "
             f"{p['origin_rps']:g} requests/s.", "",
             "| nodes | strategy | seconds | origin requests | egress MB | peak connections "
             "| first-burst stalls |", "|---:|---|---:|---:|---:|---:|---:|"]
    for n in picks:
        for strategy in ("every", "per_node", "rank0", "distcache"):
            r = d["predictions"][str(n)][strategy]
            lines.append(
                f"| {n:,} | {_STRATEGIES[strategy]} | {_s(r['seconds'])} | {r['origin_requests']:,.0f} | "
                f"{_n(r, 'egress_bytes', 1e6, '.1f')} | {_n(r, 'peak_connections')} | "
                f"{_n(r, 'first_burst_stalls')} |")
    return "\n".join(lines) + "\n"


def pool() -> str:
    d = _load("bench_pool.json")
    rows = {r["path"]: r for r in d["rows"]}
    direct, got = rows["direct read + sha256"], rows["pool.get (verified)"]
    return (f"{d['count']:,} artifacts ({d['bytes'] / 1e6:.0f} MB): `pool.get` including "
            f"SHA-256 verification vs reading the same files and hashing them: "
            f"{got['objects_per_s']:,.0f} vs {direct['objects_per_s']:,.0f} objects/s, "
            f"{got['mb_per_s']:,.0f} vs {direct['mb_per_s']:,.0f} MB/s, "
            f"**ratio {d['ratio_pool_over_direct']:.3f}** (pool.get time / direct read + "
            f"sha256 time, median of the per-round ratios over {d['rounds']} interleaved "
            "rounds; target <= 1.2).\n")


def _absent(name: str) -> str:
    """What a block says while its JSON (``docs/bench/<name>``) is not committed."""
    return (f"_Not measured in the committed figures yet (`{name}`): run the command above, "
            "then `python scripts/readme_figures.py --write`._\n")


#: The family's rows: key, label, the ratio that names its baseline, that baseline.
FAMILY_ROWS = (
    ("cold_1", "cold 1, `prefetch()`", "cold_1_vs_copy_floor", "copy floor"),
    ("cold_2x2", "cold 2x2, `prefetch()`", "cold_2x2_vs_copy_floor", "copy floor"),
    ("warm_init_1", "**warm start 1: `import distcache` + `init`**",
     "warm_init_1_vs_stat_floor", "stat floor"),
    ("warm_1", "warm 1, `prefetch()` alone", "warm_1_vs_stat_floor", "stat floor"),
    ("warm_init_2x2", "**warm start 2x2: `import distcache` + `init`**",
     "warm_init_2x2_vs_stat_floor", "stat floor"),
    ("warm_2x2", "warm 2x2, `prefetch()` alone", "warm_2x2_vs_stat_floor", "stat floor"),
)


def family() -> str:
    """``scripts/bench_family.py``: the warm start is the rows through init (the clock
    from before ``import distcache`` to ``init`` returning); the warm rows of
    ``prefetch()`` alone are given beside them, labelled so."""
    if not (BENCH / "bench_family.json").exists():
        return _absent("bench_family.json")
    d = _load("bench_family.json")
    rows, ratios = d["rows"], d["ratios"]
    floor = rows["copy_floor"]
    through_init = [key for key, *_ in FAMILY_ROWS if key.startswith("warm_init") and key in rows]
    lines = [f"{d['artifacts']:,} artifacts, {d['bytes'] / 1e9:.2f} GB ({d['source']}), "
             f"directory origin. Floors measured in the same run: one copy "
             f"(`cp`, then SHA-256 of the copy as distcache hashes, OpenSSL's, on "
             f"{floor.get('hash_threads', 1)} threads) {floor['total_s']:.2f} s; one "
             f"`os.stat` per object "
             f"{rows['stat_floor_s'] * 1e3:.1f} ms."]
    if through_init:
        lines[0] += (" A warm start runs on each rank from before `import distcache` until "
                     "`distcache.init(manifests=[M], integrations=[])` returns, the slowest "
                     "rank's; under `mpirun`, MPI_Init (`from mpi4py import MPI`, the "
                     "launcher's and the engine's cost) comes before that clock and is "
                     "given apart. The `prefetch()` rows time the collective alone, barrier "
                     "to barrier.")
    lines += ["", "| run | seconds | ratio | against | downloads | peak RSS per rank "
              "| MPI_Init, outside the clock |", "|---|---:|---:|---|---:|---:|---:|"]
    for key, label, ratio_key, against in FAMILY_ROWS:
        if key not in rows:
            continue
        r = rows[key]
        rss = max(x["maxrss_bytes"] for x in r["ranks"]) / 1e6
        target = d["targets"].get(ratio_key)
        note = "" if target is None else f" (target <= {target:g})"
        downloads = "-" if not r.get("report") else f"{r['report']['downloads']:,}"
        mpi = "-" if r.get("mpi_init_s") is None else f"{r['mpi_init_s']:.2f} s"
        lines.append(f"| {label} | {_s(r['wall_s'])} | {ratios[ratio_key]:.2f}x{note} | "
                     f"{against} | {downloads} | {rss:.0f} MB | {mpi} |")
    if not through_init:
        lines += ["", "_The warm start through `import distcache` and `init` (rows "
                  "`warm_init_1`, `warm_init_2x2`) is not in the committed figures yet; the "
                  "warm rows above are `prefetch()` alone._"]
    return "\n".join(lines) + "\n"


def engine_startup() -> str:
    """``scripts/bench_prefetch.py --strategies engine-init,engine-init-warm --ranks 4
    --name engine_startup``: rows (j) and (k), an engine start-up through ``init``, cold
    and warm, against the latency floor of the same run."""
    if not (BENCH / "engine_startup.json").exists():
        return _absent("engine_startup.json")
    d = _load("engine_startup.json")
    cfg = d["config"]
    labels = {"engine-init": "**(j) cold**", "engine-init-warm": "**(k) warm**"}
    rows = [r for r in d["results"] if r["strategy"] in labels]
    latency = d["measured"]["request_latency_s"]
    low, high = cfg["load_average_before_after"]
    before = ", ".join(f"{labels[r['strategy']].strip('*')} at N={r['ranks']}: "
                       f"{r['imports_s']:.1f} s" for r in rows)
    lines = [f"K = {cfg['artifacts']} artifacts ({cfg['artifact_bytes'] / 1e6:.1f} MB), "
             f"{cfg['injected_latency_s'] * 1e3:g} ms per request, "
             f"{cfg['bandwidth_cap_Bps'] / 1e6:g} MB/s origin cap, "
             f"{cfg['downloads_per_rank']} downloads per rank; the ranks on 2 simulated "
             f"nodes with a pool each; {cfg['cpus']} cores, load average {low:.1f} before "
             f"the run and {high:.1f} after it."
             + (f" Each row is the run with the median time of {cfg['repeat']}."
                if cfg.get("repeat", 1) > 1 else ""),
             "",
             "Each rank's clock runs from before `import distcache` through "
             "`distcache.init(manifests=[M])` with its default integrations (FlashInfer's "
             "loader wrapped) and the loading of every kernel through FlashInfer's loader, "
             "until the slowest rank is ready. The engine's own imports (mpi4py, i.e. "
             f"MPI_Init, torch, FlashInfer) come before it, outside the clock ({before}). "
             "The latency floor is that of the same run: ceil(K / concurrent downloads) x "
             f"the request latency measured at its start ({latency * 1e3:.0f} ms).",
             "",
             "| engine start-up through init | ranks | origin requests | ready s | latency "
             "floor s | x latency floor | import distcache s | init s | kernel loads s "
             "| peak RSS per rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        eng = r["engine_s"]
        # A warm start downloads nothing: no download floor, no ratio to one.
        cold = r["strategy"] not in WARM_ROWS and "vs_latency_floor" in r
        lines.append(f"| {labels[r['strategy']]} | {r['ranks']} | {r['origin_requests']} | "
                     f"{_s(r['wall_s'])} | {_s(r['latency_floor_s']) if cold else '-'} | "
                     f"{format(r['vs_latency_floor'], '.2f') + 'x' if cold else '-'} | "
                     f"{eng['import']:.3f} | "
                     f"{eng['init']:.3f} | {eng['load']:.3f} | "
                     f"{r['peak_rss_bytes'] / 1e6:.0f} MB |")
    lines += ["", "The phases are each the slowest rank's; peak RSS includes torch and "
              "FlashInfer, which the engine imports before the clock. A warm start downloads "
              "nothing, so its row has no latency floor and no ratio to one; it is held to "
              "its own target (below)."]
    bare = [b for b in d.get("baselines", []) if b["concurrent_downloads"] == 16]
    floors = [r["latency_floor_s"] for r in rows if "latency_floor_s" in r]
    if bare and latency and floors:
        # What downloading alone takes on this machine in this run, at the same concurrency.
        b = bare[0]
        lines += ["", f"In the same run one process that only downloads the K artifacts, "
                  f"16 at a time (its start-up and imports, the HTTP stack's too, outside the "
                  f"clock, as the engine's are; nothing to move or load), takes "
                  f"{_s(b['wall_s'])} s: {b['wall_s'] / floors[0]:.2f}x "
                  "the latency floor."]
    lines += ["", *_targets(d["targets"])]
    return "\n".join(lines) + "\n"


def startup() -> str:
    """``scripts/bench_scale.py`` (``scale.json``): start-up through ``init`` at N ranks
    next to the floor of the same run; and, where ``scripts/scale_model.py --startup``
    has written ``startup_scale.json``, its per-rank costs extrapolated to 1,024 and
    4,096 nodes. One self-contained block: README.md shows it too."""
    if not (BENCH / "scale.json").exists():
        return _absent("scale.json")
    d = _load("scale.json")
    machine = d.get("machine", {})
    lines = ["| ranks (nodes) | origin requests | init, slowest rank (runs) | floor (runs) "
             "| init / floor | init - floor | after MPI_Init: init, floor "
             "| peak RSS per rank | floor RSS | largest bucket | control bytes per rank (max) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        after = r.get("after_mpi_init_s")
        lines.append(
            f"| {r['ranks']:,} ({r['nodes']:,}) | {r['origin_requests']:,} | "
            f"{r['init_slowest_s']:.1f} s ({min(r['init_runs_s']):.1f}-"
            f"{max(r['init_runs_s']):.1f}) | {r['floor_s']:.1f} s ({min(r['floor_runs_s']):.1f}-"
            f"{max(r['floor_runs_s']):.1f}) | {r['init_over_floor']:.2f}x | "
            f"{r['init_slowest_s'] - r['floor_s']:.1f} s | "
            + (f"{after['init']['last_to_end']:.2f} s, {after['floor']['last_to_end']:.2f} s | "
               if after else "- | ")
            + f"{r['peak_rss_mb']:.1f} MB | {r['floor_rss_mb']:.1f} MB | "
            f"{r['largest_bucket_mb']:.2f} MB | {r['control_bytes_per_rank']['max']:,} |")
    if machine:
        lines += ["", f"Measured on {machine['cores']} cores, load average "
                  f"{machine['load_before']:g} before the run and {machine['load_after']:g} "
                  "after it: compare each row's init with the floor in its own row. Both "
                  "clocks start when `mpirun` is launched, so MPI_Init (the same in both, and "
                  "most of the time at 128 and 256 ranks) weighs in each ratio, and its spread "
                  "from launch to launch can exceed the difference; \"after MPI_Init\" times "
                  "from the last rank leaving MPI_Init to the slowest rank's end: "
                  "distcache's own share of the start-up, which no ratio above shows."]
    if not (BENCH / "startup_scale.json").exists():
        lines += ["", "_The extrapolation to 4,096 nodes (`startup_scale.json`, from "
                  "`python scripts/scale_model.py --startup docs/bench/scale.json --out "
                  "docs/bench`) is not in the committed figures yet._"]
        return "\n".join(lines) + "\n"
    model = _load("startup_scale.json")
    fits, picks = model["fits"], [n for n in (1024, 4096) if str(n) in model["predictions"]]
    costs = [cost for cost in STARTUP_COSTS if cost[0] in fits]
    measured = model["measured"]["nodes"]

    fitted = [f"{label} {fits[key]['a']:,{a_spec}} + {fits[key]['b_per_node']:,{b_spec}}"
              f"{unit} x nodes (slope {fits[key]['b_low_95']:,{b_spec}} to "
              f"{fits[key]['b_high_95']:,{b_spec}})"
              for key, label, _, unit, a_spec, b_spec, _ in costs
              if fits[key]["slope_resolved"]]
    unresolved = [f"{label}: slope {fits[key]['b_per_node']:,{b_spec}}{unit} per node, "
                  f"95 % interval {fits[key]['b_low_95']:,{b_spec}} to "
                  f"{fits[key]['b_high_95']:,{b_spec}}, which holds zero: the measured points "
                  "do not resolve whether it grows with the job, so no value is extrapolated "
                  "for it, only its upper bound"
                  for key, label, _, unit, _, b_spec, _ in costs
                  if not fits[key]["slope_resolved"]]
    lines += ["", f"Extrapolated by a model, not measured (`scripts/scale_model.py --startup`): "
              f"each per-rank cost measured at {min(measured):.0f} to {max(measured):.0f} "
              f"nodes ({len(measured)} points), fitted as a + b x nodes by least squares, "
              "with the slope's 95 % interval and, in brackets in the table, the fit's 95 % "
              "upper bound: " + "; ".join(fitted + unresolved) + ".", "",
              "| nodes (ranks) | " + " | ".join(
                  f"{short}: {'fit' if fits[key]['slope_resolved'] else 'not resolved'} "
                  "(95 % upper bound)" for key, _, short, *_ in costs) + " |",
              "|---:|" + "---:|" * len(costs)]
    for n in picks:
        p = model["predictions"][str(n)]
        cells = []
        for key, _, _, unit, _, _, spec in costs:
            upper = p.get(f"{key}_upper_95")
            bound = "-" if upper is None else f"{upper:,{spec}}{unit}"
            cells.append(f"{p[key]:,{spec}}{unit} ({bound})" if fits[key]["slope_resolved"]
                         else f"- ({bound})")
        lines.append(f"| {n:,} ({p['ranks']:,}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The start-up model's per-rank costs: key, label, column, unit, and the formats of
#: the intercept, the slope and an extrapolated value.
STARTUP_COSTS = (
    ("control_bytes_max", "control bytes per rank (max)", "control bytes per rank (max)", "",
     ".0f", ".0f", ".0f"),
    ("distcache_cpu_s", "distcache's CPU per rank (import and init, this machine)",
     "distcache CPU per rank", " s", ".3f", ".5f", ".2f"),
    ("rss_beyond_bucket_mb", "peak RSS beyond the floor's and the largest bucket's",
     "peak RSS beyond floor and bucket", " MB", ".1f", ".3f", ".0f"),
)


def downloads() -> str:
    d = _load("bench_downloads.json")
    sets = sorted({r["set"] for r in d["rows"]}, key=[r["set"] for r in d["rows"]].index)
    caps = sorted({r["cap"] for r in d["rows"]})
    cell = {(r["set"], r["cap"]): r for r in d["rows"]}
    sizes = ", ".join(f"{s} {cell[s, caps[0]]['artifacts']:,} artifacts "
                      f"({cell[s, caps[0]]['bytes'] / 1e6:.0f} MB)" for s in sets)
    lines = [f"One process against a loopback origin with {d['latency_s'] * 1e3:.0f} ms per "
             f"request and {d['bandwidth_Bps'] / 1e6:.0f} MB/s in all; {sizes}; the median "
             f"of {d['reps']} runs per cell, in seconds, with the ratio to the floor at that "
             "concurrency (ceil(K / cap) x latency + bytes / bandwidth).", "",
             "| cap | requests/s at most | " + " | ".join(sets) + " |",
             "|---:|---:|" + "---:|" * len(sets)]
    for cap in caps:
        row = " | ".join(f"{_s(cell[s, cap]['wall_s'])} ({cell[s, cap]['vs_floor']:.2f}x)"
                         for s in sets)
        lines.append(f"| {cap} | {cell[sets[0], cap]['peak_requests_per_s']:,.0f} | {row} |")
    best = ", ".join(f"{s} {_s(v)} s" for s, v in d["best_s"].items())
    lines += ["", f"Best: {best}. Smallest cap within {d['within']:g}x of the best on every "
              f"set: **{d['chosen_cap']}**."]
    return "\n".join(lines) + "\n"


def ipc() -> str:
    d = _load("bench_ipc.json")
    t = d["targets"]
    cols = [("floor_one_op", "one-op floor"), ("open_per_feature_lean", "(a') lean attach"),
            ("open_per_feature", "(a) SharedMemory attach"), ("handle_cache", "(b) lazy cache"),
            ("registry_resolve_ack", "(c) resolve + ack"), ("floor_copy", "copy floor"),
            ("registry_fetch", "(d) fetch")]
    lines = ["| feature | " + " | ".join(label for _, label in cols) + " |",
             "|---:|" + "---:|" * len(cols)]
    over_floor, under_attach, fetch_ratio = [], [], []
    for row in d["rows"]:
        m = {k: v["median_us"] for k, v in row["methods"].items()}
        size = row["feature_bytes"]
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(f"| {label} | " + " | ".join(f"{m[k]:.2f}" for k, _ in cols) + " |")
        over_floor.append(m["registry_resolve_ack"] / m["floor_one_op"])
        under_attach.append(m["open_per_feature_lean"] / m["registry_resolve_ack"])
        fetch_ratio.append(m["registry_fetch"] / m["floor_copy"])

    def span(xs: list[float]) -> str:
        return f"{min(xs):.2f}-{max(xs):.2f}x"

    def verdict(ok: bool) -> str:
        return "holds" if ok else "missed"

    opens = d["opens_per_consumer"]
    lines += ["", f"µs per feature, median of {d['rows'][0]['iters']:,} per size. "
              f"(c) resolve + ack is {span(over_floor)} the one-op floor (target <= "
              f"{t['max_registry_over_one_op_floor']:g}x: "
              f"{verdict(t['registry_within_2x_one_op_floor'])}) and {span(under_attach)} "
              f"cheaper than the lean attach (a') (target >= "
              f"{t['min_lean_attach_over_registry']:g}x: "
              f"{verdict(t['registry_10x_below_lean_attach'])}); (d) fetch is "
              f"{span(fetch_ratio)} its copy floor (target <= "
              f"{t['max_fetch_over_copy_floor']:g}x: {verdict(t['fetch_within_2x_copy_floor'])}). "
              f"Opens per consumer per pool: (a) "
              f"{max(opens['open_per_feature'].values()):,}, (b) "
              f"{max(opens['handle_cache'].values())}, (c)/(d) "
              f"{max(opens['registry_resolve_ack'].values())}."]
    return "\n".join(lines) + "\n"


def soak() -> str:
    d = _load("soak.json")
    faults = ", ".join(f"{k} {v}" for k, v in d["faults"].items())
    killed_during = d["outcomes"].get("killed_during_round", 0)
    killed_after = d["outcomes"].get("killed_after_round", 0)
    rows = [("seed", f"{d['seed']}"),
            ("fault rounds / clean rounds", f"{d['rounds']:,} / {d['clean_rounds']:,}"),
            ("mpirun jobs", f"{d['jobs']:,}"),
            ("rounds with a SIGKILLed rank (during / after the round)",
             f"{killed_during + killed_after:,} ({killed_during} / {killed_after})"),
            ("fault rounds that failed collectively (PrefetchError on every rank)",
             f"{d['outcomes'].get('failed', 0):,}"),
            ("hangs", f"{d['hangs']}"), ("corrupt objects served", f"{d['corrupt_served']}"),
            ("deliberately corrupted objects found and quarantined",
             f"{d['corrupt_detected']:,}"),
            ("objects lost", f"{d['lost']}"), ("partial objects visible", f"{d['partial']}"),
            ("temp files leaked", f"{d['tmp_leaks']}"),
            ("clean-round origin requests = objects missing everywhere",
             f"{d['clean_requests']:,} = {d['clean_expected']:,}"),
            ("violations", f"{len(d['violations'])}"),
            ("wall time", f"{d['seconds'] / 60:.1f} min")]
    lines = ["| long soak | |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows), "",
             f"Faults drawn: {faults}."]
    return "\n".join(lines) + "\n"


def jit() -> str:
    """``docs/jit.md``: ``scripts/bench_jit.py``'s cells, per node the median of its
    ranks' medians over the runs."""
    d = _load("jit.json")
    cells, runs = d["cells"], d["runs"]
    nodes = sorted({r["node"] for rows in cells.values() for r in rows})

    def median(name: str, node: str, key: str) -> float:
        return statistics.median(r[key] for r in cells[name] if r["node"] == node)

    def per_node(name: str, key: str) -> str:
        return ", ".join(f"{median(name, n, key):.1f}" for n in nodes)

    def hits(name: str) -> str:
        seen = {f"{sum(r['hit'] for r in run[name] if r['node'] == n)}:"
                f"{sum(r['miss'] for r in run[name] if r['node'] == n)}"
                for run in runs for n in nodes}
        return " or ".join(sorted(seen)) + " per node"

    labels = {"cold": "cold (baseline)", "warm local": "warm local",
              "fresh node": "fresh node through distcache"}
    low, high = d["load_average"]
    lines = [f"{d['model']}; {d['shape']}. Medians of {d['repeat']} runs on a "
             f"{d['cpus']}-core machine shared with other work (load average {low:.1f} "
             f"before, {high:.1f} after), per node:", "",
             "| scenario | node | first call (s) | init (s) | init + first call (s) "
             "| fxgraph hit : miss |", "|---|---|---|---|---|---|"]
    for name, label in labels.items():
        lines.append(f"| {label} | {', '.join(n.upper() for n in nodes)} | "
                     f"{per_node(name, 'first_call_s')} | {per_node(name, 'init_s')} | "
                     f"{per_node(name, 'init_plus_first_call_s')} | {hits(name)} |")
    last, control = nodes[-1], nodes[0]
    filled = [sum(r["filled_files"] for r in run["fresh node"] if r["node"] == last)
              for run in runs]
    kbytes = [sum(r["filled_bytes"] for r in run["fresh node"] if r["node"] == last) / 1e3
              for run in runs]
    longer = ", ".join(f"{median('fresh node', n, 'init_s') - median('warm local', n, 'init_s'):.1f}"
                       for n in nodes)
    cold = ", ".join(f"{median('cold', n, 'first_call_s') / median('warm local', n, 'first_call_s'):.1f}x"
                     for n in nodes)

    def first(name: str, node: str) -> float:
        return median(name, node, "first_call_s")

    def per_run(run: dict[str, list[dict[str, Any]]]) -> float:
        """One run's fresh node / warm local, init + first call, the node's ranks' median."""
        def both(name: str) -> float:
            return statistics.median(r["init_s"] + r["first_call_s"] for r in run[name]
                                     if r["node"] == last)
        return both("fresh node") / both("warm local")

    calls = [r["first_call_s"] for run in runs for name in ("warm local", "fresh node")
             for r in run[name]]
    lines += ["", f"Fresh node / warm local, node {last.upper()}: init + first call "
              f"{d['fresh_over_warm_local_node_b_with_init']:.2f}x (target: at most "
              f"{d['target_fresh_over_warm_local']:g}x), per run "
              f"{' / '.join(f'{per_run(run):.2f}x' for run in runs)}. No first-call speed-up "
              f"is claimed: node {control.upper()}, whose cache directory and pool are the "
              f"same in both scenarios (the control), drops about as much, its first call "
              f"{first('warm local', control):.1f} -> {first('fresh node', control):.1f} s "
              f"({first('fresh node', control) / first('warm local', control):.2f}x) against "
              f"node {last.upper()}'s {first('warm local', last):.1f} -> "
              f"{first('fresh node', last):.1f} s "
              f"({first('fresh node', last) / first('warm local', last):.2f}x). Each run "
              "launches the scenarios in the same order (cold, warm local, fresh node), and "
              f"a rank's first call in those two scenarios ranged {min(calls):.2f}-"
              f"{max(calls):.2f} s over the runs. On the fresh node `init` takes "
              f"{longer} s longer than warm local (nodes {', '.join(n.upper() for n in nodes)}); "
              f"node {last.upper()}'s ranks filled {' / '.join(map(str, filled))} files "
              f"({' / '.join(f'{k:.0f}' for k in kbytes)} kB) from the pool at `init`, per run. "
              f"Cold over warm local, first call: {cold}."]
    return "\n".join(lines) + "\n"


def _script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"_figures_{name}",
                                                  ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_vllm() -> str:
    """``docs/engines.md``: the engine check's own table (``scripts/engine_vllm.py``
    renders it, and rewrites this block after a run into ``docs/bench``)."""
    table: str = _script("engine_vllm").render(_load("engine_vllm.json"))
    return table


RENDERERS: dict[str, Callable[[], str]] = {
    "prefetch": prefetch, "engine_startup": engine_startup, "scale": scale,
    "startup": startup, "pool": pool, "family": family, "downloads": downloads, "ipc": ipc,
    "soak": soak, "jit": jit, "engine_vllm": engine_vllm}


def render(name: str) -> str:
    return RENDERERS[name]()


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the blocks in place (default: print the pages that hold "
                             "blocks, rewritten)")
    args = parser.parse_args()
    for page in pages():
        text = page.read_text()
        if not BLOCK.search(text):
            continue
        new = rewrite(text)
        name = page.relative_to(ROOT)
        if args.write:
            if new != text:
                page.write_text(new)
            print(f"{name}: blocks rewritten" if new != text else f"{name}: already current")
        else:
            sys.stdout.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
