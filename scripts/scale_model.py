"""Scale model: predicted cold start and origin requests from 1 to 4,096 nodes.

A model on paper, driven by the cost parameters that ``scripts/bench_prefetch.py``
measured (per-request latency, per-connection origin bandwidth, broadcast latency
alpha and per-byte cost beta) and the artifact set it used. For each strategy of that
benchmark it predicts the cold-start time of a job and the requests the origin sees:

every      each rank downloads every artifact itself (FlashInfer's loader with a cubin
           directory per rank, the layout of engines that give each rank its own)
per_node   one download per node (FlashInfer's default: one cubin directory per node,
           whose file lock lets one rank download while the node's others wait)
rank0      rank 0 downloads everything, then broadcasts it to one receiver per node
distcache  downloads spread over ranks, then a bucketed broadcast to one writer per
           node (node-local pools; the node's other ranks read the same pool)

rank0 and distcache get the same concurrency: C = min(ranks x downloads per rank,
downloads per job) connections to the origin in all, so their times differ only by
how the downloads are spread (the coordination rounds before the downloads, which
``scripts/bench_scale.py`` measures, are not modelled). What distcache buys over
``every`` and ``per_node`` is stated next to time: origin requests, egress bytes, the
peak connections the origin sees (its
rate-limit exposure, as a multiple of ``--origin-connections``) and the requests of
the first burst beyond what the origin admits in one request latency
(``--origin-rps`` x latency): those stall or are refused with 429.

Assumptions (stated, not measured here): ``--gpus-per-node`` ranks per node; the origin
(a CDN) serves at most ``--origin-aggregate`` bytes/s and ``--origin-rps`` requests/s in
total, beyond which requests queue; a broadcast is a binomial tree, costing
ceil(log2 P) * (alpha + m * beta) per message of m bytes over P participants.

The lazy path (``--lazy``, with ``docs/bench/lazy.json`` from ``scripts/bench_lazy.py``):
one kernel that no manifest named, needed by every node in the same second. With
node-local pools and no peers each node asks the origin (N requests; beyond
``--origin-rps`` x latency they queue); with peers the owner node asks once and the
other N - 1 nodes copy from it, the owner sending at most ``--peer-transfers`` at a
time at ``--peer-bandwidth`` each, plus the measured peer lookup (median).

The start-up path (``--startup``, with ``docs/bench/scale.json`` from
``scripts/bench_scale.py``): each rank's control bytes, peak RSS beyond the floor's and the
largest bucket's, and
the CPU seconds of ``import distcache`` and ``init`` (after MPI_Init), measured at 2 to 32 nodes, fitted as ``a + b x nodes`` and
extrapolated to 4,096 nodes (``startup_scale.json``), each with the 95 % interval of its
slope and the 95 % upper bound of the fit at each N. A cost whose slope interval holds
zero is not resolved at the measured scale: the model gives no value for it, only the
upper bound.

    python scripts/scale_model.py --bench bench-results/bench_prefetch.json --out bench-results
    python scripts/scale_model.py --bench docs/bench/bench_prefetch.json --lazy docs/bench/lazy.json --out docs/bench
    python scripts/scale_model.py --startup docs/bench/scale.json --out docs/bench
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path


def fetch_time(k: float, nbytes: float, latency: float, bandwidth: float, conc: int) -> float:
    """One rank fetching k artifacts (nbytes in all) with conc concurrent requests."""
    return math.ceil(k / conc) * latency + nbytes / (conc * bandwidth) if k else 0.0


def bcast_time(nbytes: float, participants: int, alpha: float, beta: float, bucket: float) -> float:
    if participants <= 1 or nbytes <= 0:
        return 0.0
    messages = math.ceil(nbytes / bucket)
    return math.ceil(math.log2(participants)) * (messages * alpha + nbytes * beta)


def predict(nodes: int, p: dict[str, float]) -> dict[str, dict[str, float]]:
    ranks = nodes * int(p["gpus_per_node"])
    k, size = p["artifacts"], p["artifact_bytes"]
    lat, bw, per_rank = p["request_latency_s"], p["origin_bandwidth_Bps"], int(p["downloads_per_rank"])
    agg, rps = p["origin_aggregate_Bps"], p["origin_rps"]
    alpha, beta, bucket = p["bcast_alpha_s"], p["bcast_beta_s_per_byte"], p["bucket_bytes"]
    # The same total concurrency for rank0 and distcache.
    conc = int(min(ranks * per_rank, p["downloads_per_job"]))
    admitted = rps * lat

    def origin_floor(requests: float, nbytes: float) -> float:
        return max(nbytes / agg, requests / rps)

    def row(seconds: float, requests: float, connections: float) -> dict[str, float]:
        connections = burst = min(connections, requests)
        return {"seconds": seconds, "origin_requests": requests, "egress_bytes":
                size * requests / k, "peak_connections": connections,
                "rate_limit_exposure": connections / p["origin_connections"],
                "first_burst_stalls": max(0.0, burst - admitted)}

    every_req = ranks * k
    every = max(fetch_time(k, size, lat, bw, per_rank), origin_floor(every_req, ranks * size))
    node_req = nodes * k  # the node's first rank at the per-rank count, the others wait
    per_node = max(fetch_time(k, size, lat, bw, per_rank), origin_floor(node_req, nodes * size))
    rank0 = max(fetch_time(k, size, lat, bw, conc), origin_floor(k, size)) + bcast_time(
        size, nodes, alpha, beta, bucket)
    # As few ranks as carry the job's connections at the per-rank count (the plan).
    downloaders = max(1, min(ranks, int(k), -(-int(p["downloads_per_job"]) // per_rank)))
    threads = max(1, min(per_rank, conc // downloaders))
    spread = max(fetch_time(k / downloaders, size / downloaders, lat, bw, threads),
                 origin_floor(k, size))
    dist = spread + bcast_time(size, nodes, alpha, beta, bucket)
    return {
        "every": row(every, every_req, ranks * per_rank),
        "per_node": row(per_node, node_req, nodes * per_rank),
        "rank0": row(rank0, k, conc),
        "distcache": row(dist, k, downloaders * threads),
    }


def predict_lazy(nodes: int, size: float, lat: float, bw: float, rps: float,
                 peer_s: float, peer_bw: float, transfers: int) -> dict[str, dict[str, float]]:
    """One lazy kernel of ``size`` bytes needed by ``nodes`` nodes at once."""
    # Per pool: N requests; the origin admits rps x latency per latency, the rest queue.
    per_pool = max(lat, nodes / rps) + size / bw
    # Peers: the owner's one request, then N - 1 copies out of the owner, transfers at a
    # time; the last asker waits for its wave.
    waves = math.ceil(max(nodes - 1, 0) / transfers)
    peers = lat + size / bw + peer_s + waves * size / peer_bw
    return {"per_pool": {"seconds": per_pool, "origin_requests": float(nodes),
                         "first_burst_stalls": max(0.0, nodes - rps * lat)},
            "peers": {"seconds": peers, "origin_requests": 1.0, "first_burst_stalls": 0.0}}


def lazy_table(lazy: Path, args: argparse.Namespace) -> dict[str, object]:
    """The lazy path from 1 to 4,096 nodes (and 1,000), from the measured peer lookup."""
    measured = json.loads(lazy.read_text())
    peer = measured["results"]["distcache_peers"]["latency"]["burst/peer"]["median_ms"] / 1e3
    lat = float(measured["setup"]["origin_latency_s"])
    size, bw = 120e3, args.origin_aggregate / max(args.origin_connections, 1.0)
    axis = sorted({2**i for i in range(13)} | {1000})
    table = {n: predict_lazy(n, size, lat, bw, args.origin_rps, peer, args.peer_bandwidth,
                             args.peer_transfers) for n in axis}
    print(f"lazy path: one {size / 1e3:.0f} KB kernel, origin latency {lat:g} s, "
          f"peer lookup {peer * 1e3:.1f} ms (measured), {args.origin_rps:g} origin req/s")
    print(f"{'nodes':>6} | {'per-pool s':>10} {'requests':>9} {'stalls':>7} | "
          f"{'peers s':>8} {'requests':>8}")
    for n, row in table.items():
        a, b = row["per_pool"], row["peers"]
        print(f"{n:>6} | {a['seconds']:>10.3f} {a['origin_requests']:>9.0f} "
              f"{a['first_burst_stalls']:>7.0f} | {b['seconds']:>8.3f} {b['origin_requests']:>8.0f}")
    return {"measured_from": str(lazy), "kernel_bytes": size, "origin_latency_s": lat,
            "peer_lookup_s": peer, "origin_rps": args.origin_rps,
            "peer_bandwidth_Bps": args.peer_bandwidth, "peer_transfers": args.peer_transfers,
            "predictions": {str(n): row for n, row in table.items()}}


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``a + b * x`` through the points (``b`` = 0 for one point)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - b * mx, b


#: Student's t, two-sided 95 %, by degrees of freedom (1 to 30).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _t95(df: int) -> float:
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959964  # beyond 30: the normal quantile with its first two corrections
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _interval(xs: list[float], ys: list[float], a: float, b: float
              ) -> tuple[float, float, Callable[[float], float]] | None:
    """The slope's 95 % interval and the fit's 95 % upper bound as a function of x, or
    None with fewer than three points (no residual to estimate the noise from)."""
    n = len(xs)
    mx = sum(xs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 3 or sxx == 0:
        return None
    s2 = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True)) / (n - 2)
    t = _t95(n - 2)
    half = t * math.sqrt(s2 / sxx)

    def upper(x: float) -> float:
        return a + b * x + t * math.sqrt(s2 * (1 / n + (x - mx) ** 2 / sxx))

    return b - half, b + half, upper


#: The per-rank costs of start-up that ``scripts/bench_scale.py`` measures at each N
#: (``rows[].per_rank``, and the CPU per rank), and their units.
STARTUP_COSTS = {
    "control_bytes_max": "bytes",
    "rss_beyond_bucket_mb": "MB",
    "distcache_cpu_s": "s",
}


def startup_table(scale: Path) -> dict[str, object]:
    """Start-up per rank from 1 to 4,096 nodes: each per-rank cost measured by
    ``bench_scale`` at 2 to 32 nodes, fitted as ``a + b * nodes`` (the collective's
    payloads hold one block per node) and extrapolated."""
    measured = json.loads(scale.read_text())
    rows = measured["rows"]
    nodes = [float(r["nodes"]) for r in rows]
    series: dict[str, list[float]] = {key: [] for key in STARTUP_COSTS}
    for r in rows:
        per = r["per_rank"]
        series["control_bytes_max"].append(float(per["control_bytes_max"]))
        # What a rank holds beyond the floor's and the largest bucket it moved (the
        # bucket is bounded by DISTCACHE_BUCKET_BYTES, not by the job).
        series["rss_beyond_bucket_mb"].append(
            float(per["peak_rss_over_floor_mb"]) - float(r["largest_bucket_mb"]))
        series["distcache_cpu_s"].append(float(per["distcache_cpu_s"]))
    fits = {key: _fit(nodes, ys) for key, ys in series.items()}
    intervals = {key: _interval(nodes, series[key], *fits[key]) for key in fits}
    # A slope whose 95 % interval holds zero is the measurement's noise, not a trend the
    # points resolve: no value is extrapolated from it, only its upper bound.
    resolved = {key: iv is not None and (iv[0] > 0 or iv[1] < 0)
                for key, iv in intervals.items()}
    axis = [2**i for i in range(13)]
    per_node = int(measured["ranks_per_node"])
    predictions: dict[str, dict[str, float | None]] = {}
    for n in axis:
        row: dict[str, float | None] = {"ranks": n * per_node}
        for key, (a, b) in fits.items():
            iv = intervals[key]
            row[key] = a + b * n if resolved[key] else None
            row[f"{key}_upper_95"] = None if iv is None else iv[2](n)
        predictions[str(n)] = row
    print(f"start-up per rank from {scale} ({len(rows)} measured rows, "
          f"{per_node} ranks per node), fitted a + b x nodes (slope's 95 % interval):")
    for key, (a, b) in fits.items():
        iv = intervals[key]
        span = "-" if iv is None else f"{iv[0]:,.4g} to {iv[1]:,.4g}"
        print(f"  {key:<24} a = {a:,.4g}  b = {b:,.4g} ({span}) {STARTUP_COSTS[key]} per node"
              + ("" if resolved[key] else ": slope not resolved"))

    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"{'nodes':>6} {'ranks':>7} | {'control B/rank (upper)':>24} "
          f"{'RSS beyond MB (upper)':>22} {'distcache CPU s (upper)':>24}")
    for n in axis:
        p = predictions[str(n)]
        print(f"{n:>6} {p['ranks']:>7,.0f} | "
              + " ".join(f"{cell(p[key], spec):>11} ({cell(p[f'{key}_upper_95'], spec)})"
                         for key, spec in (("control_bytes_max", ",.0f"),
                                           ("rss_beyond_bucket_mb", ".1f"),
                                           ("distcache_cpu_s", ".3f"))))
    return {"measured_from": str(scale), "ranks_per_node": per_node,
            "measured": {"nodes": nodes, **series},
            "fits": {key: {"a": a, "b_per_node": b, "unit": STARTUP_COSTS[key],
                           "b_low_95": None if intervals[key] is None else intervals[key][0],
                           "b_high_95": None if intervals[key] is None else intervals[key][1],
                           "slope_resolved": resolved[key]}
                     for key, (a, b) in fits.items()},
            "nodes": axis, "predictions": predictions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=Path("bench-results/bench_prefetch.json"),
                        help="JSON written by scripts/bench_prefetch.py")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--artifacts", type=int, default=None,
                        help="artifacts per job (default: the benchmark's)")
    parser.add_argument("--origin-aggregate", type=float, default=10e9 / 8,
                        help="origin total bytes/s (default 10 Gbit/s)")
    parser.add_argument("--origin-rps", type=float, default=1000.0,
                        help="origin total requests/s before it queues or refuses")
    parser.add_argument("--bucket-bytes", type=float, default=64 << 20)
    parser.add_argument("--downloads-per-job", type=int, default=32,
                        help="cap on concurrent downloads over the job (DISTCACHE_DOWNLOADS_PER_JOB)")
    parser.add_argument("--origin-connections", type=float, default=256.0,
                        help="concurrent connections the origin allows one client")
    parser.add_argument("--lazy", type=Path, default=None,
                        help="JSON written by scripts/bench_lazy.py: add the lazy path")
    parser.add_argument("--peer-bandwidth", type=float, default=10e9 / 8,
                        help="bytes/s one agent sends to one peer (default 10 Gbit/s)")
    parser.add_argument("--peer-transfers", type=int, default=16,
                        help="copies an agent sends at once (the agent's transfer cap)")
    parser.add_argument("--startup", type=Path, default=None,
                        help="JSON written by scripts/bench_scale.py: extrapolate its "
                             "per-rank start-up costs to 4,096 nodes")
    args = parser.parse_args()
    if args.startup is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "startup_scale.json").write_text(
            json.dumps(startup_table(args.startup), indent=2) + "\n")
        print(f"wrote {args.out / 'startup_scale.json'}")
        return 0
    if args.lazy is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lazy_scale.json").write_text(
            json.dumps(lazy_table(args.lazy, args), indent=2) + "\n")
        print(f"wrote {args.out / 'lazy_scale.json'}")
        return 0

    bench = json.loads(args.bench.read_text())
    cfg, measured = bench["config"], bench["measured"]
    k = float(args.artifacts if args.artifacts is not None else cfg["artifacts"])
    params = {
        "gpus_per_node": args.gpus_per_node,
        "artifacts": k,
        "artifact_bytes": cfg["artifact_bytes"] * k / cfg["artifacts"],
        "downloads_per_rank": cfg["downloads_per_rank"],
        "origin_aggregate_Bps": args.origin_aggregate,
        "origin_rps": args.origin_rps,
        "bucket_bytes": args.bucket_bytes,
        "downloads_per_job": args.downloads_per_job,
        "origin_connections": args.origin_connections,
        **{key: float(v) for key, v in measured.items()},
    }
    nodes_axis = [2**i for i in range(13)]
    table = {n: predict(n, params) for n in nodes_axis}

    print(f"scale model from {args.bench}: {int(k)} artifacts, "
          f"{params['artifact_bytes'] / 1e6:.1f} MB, {args.gpus_per_node} GPUs/node")
    print("measured: " + ", ".join(f"{key}={measured[key]:.3g}" for key in measured))
    print(f"{'nodes':>6} | {'every s':>8} {'requests':>9} {'conns':>7} {'stalls':>7} | "
          f"{'per_node s':>10} {'requests':>8} | "
          f"{'rank0 s':>8} | {'distcache s':>11} {'requests':>8} {'conns':>5} {'stalls':>6}")
    for n, row in table.items():
        e, r, d, pn = row["every"], row["rank0"], row["distcache"], row["per_node"]
        print(f"{n:>6} | {e['seconds']:>8.2f} {e['origin_requests']:>9.0f} "
              f"{e['peak_connections']:>7.0f} {e['first_burst_stalls']:>7.0f} | "
              f"{pn['seconds']:>10.2f} {pn['origin_requests']:>8.0f} | "
              f"{r['seconds']:>8.3f} | {d['seconds']:>11.3f} {d['origin_requests']:>8.0f} "
              f"{d['peak_connections']:>5.0f} {d['first_burst_stalls']:>6.0f}")

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"parameters": params, "nodes": nodes_axis,
              "predictions": {str(n): row for n, row in table.items()}}
    (args.out / "scale_model.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return 0
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=90)
    for strategy, style in (("every", "o-"), ("per_node", "d-"), ("rank0", "s-"),
                            ("distcache", "^-")):
        left.plot(nodes_axis, [table[n][strategy]["seconds"] for n in nodes_axis], style,
                  label=strategy, markersize=3)
        right.plot(nodes_axis, [table[n][strategy]["origin_requests"] for n in nodes_axis],
                   style, label=strategy, markersize=3)
    for ax, title in ((left, "predicted cold start (s)"), (right, "origin requests")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"nodes ({args.gpus_per_node} ranks each)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "scale_model.png")
    print(f"wrote {args.out / 'scale_model.json'} and {args.out / 'scale_model.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
