"""The demo job: a 4-rank, 2-node launch against a local origin, cold then warm.

Starts a loopback origin over a generated artifact set of realistic cubin sizes (or
the real cubins of an installed ``flashinfer-cubin`` package), launches 4 ranks as two
simulated nodes under ``mpirun`` (each node with its own pool), runs
``distcache.init`` (prefetch + IPC exchange + a burst of features between ranks) and
prints what happened. Then it launches again to show the warm start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from distcache.artifact import Artifact, manifest_text, parse_checksums
from distcache.testing import LoopbackOrigin, make_artifacts

HERE = Path(__file__).resolve().parent


def mpirun() -> str:
    """The ``mpirun`` installed beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("mpirun")
    return str(beside) if beside.exists() else "mpirun"


def _flashinfer_cubins(limit: int) -> tuple[Path, list[Artifact]] | None:
    """The real cubins of an installed flashinfer-cubin package, if any."""
    try:
        import flashinfer_cubin  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = Path(flashinfer_cubin.__file__).parent / "cubins"
    found = sorted(root.rglob("checksums.txt"))
    if not found:
        return None
    artifacts: list[Artifact] = []
    for checksums in found:
        prefix = checksums.parent.relative_to(root).as_posix()
        for art in parse_checksums(checksums.read_text(), prefix=prefix):
            if (root / art.name).is_file():
                artifacts.append(art)
    return (root, artifacts[:limit]) if artifacts else None


def _run_job(args: argparse.Namespace, work: Path, url: str, manifest: Path, n: int) -> dict:
    report = work / f"run{n}.json"
    per_node = args.ranks // args.nodes
    cmd = [mpirun(), "--oversubscribe"]
    for node in range(args.nodes):
        node_id = f"node-{chr(ord('a') + node)}"
        if node:
            cmd.append(":")
        cmd += [
            "-n", str(per_node),
            "-x", f"DISTCACHE_NODE_ID={node_id}",
            "-x", f"DISTCACHE_POOL={work / 'pools' / node_id}",
            sys.executable, str(HERE / "demo_rank.py"),
            "--manifest", str(manifest), "--origin", url, "--report", str(report),
            "--features", str(args.features),
        ]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               DISTCACHE_TIMEOUT=str(args.timeout))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit(f"demo: run {n} did not finish in {args.timeout + 30} s; killed") from None
    if rc != 0:
        raise SystemExit(f"demo: run {n} failed (mpirun exit code {rc})")
    data = json.loads(report.read_text())
    data["wall_s"] = time.perf_counter() - start
    return data


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _print_run(n: int, title: str, data: dict, origin_requests: int, origin_bytes: int) -> None:
    pf = data["prefetch"]
    print(f"\n== run {n}: {title} ({data['world_size']} ranks, {data['backend']} backend, "
          f"wall {data['wall_s']:.1f} s incl. process start)")
    rows = [
        ("artifacts in manifest", f"{pf['artifacts']}"),
        ("origin downloads", f"{pf['downloads']}"),
        ("origin requests (server count)", f"{origin_requests}"),
        ("bytes from origin", _mib(pf["origin_bytes"])),
        ("bytes broadcast between ranks", _mib(pf["broadcast_bytes"])),
        ("bytes received by pools lacking them", _mib(pf["received_bytes"])),
        ("downloading ranks", ", ".join(str(r) for r in pf["downloaders"]) or "none"),
        ("pool hits", f"{pf['pool_hits']}"),
        ("objects published", f"{pf['objects_published']}"),
    ]
    for label, value in rows:
        print(f"  {label:<38} {value}")
    phases = " ".join(f"{k}={v:.2f}s" for k, v in pf["seconds"].items())
    print(f"  {'prefetch phases (max over ranks)':<38} {phases}")
    print(f"  {'IPC features resolved / checked':<38} "
          f"{sum(r['resolved'] for r in data['ranks'])} / "
          f"{sum(r['checked'] for r in data['ranks'])}")
    print("  IPC opens per (consumer rank, pool):")
    for r in data["ranks"]:
        opens = ", ".join(f"{pid}={count}" for pid, count in sorted(r["opens"].items()))
        print(f"    rank {r['rank']} ({r['node']}, pool {r['pool_id'][:8]}, "
              f"{r['pool_objects']} objects): {opens}")
    _ = origin_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--artifacts", type=int, default=64)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.02,
                        help="injected per-request origin latency, seconds")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--work", type=Path, default=Path("out/demo"))
    args = parser.parse_args()
    if args.ranks % args.nodes:
        parser.error("--ranks must be a multiple of --nodes")

    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    real = _flashinfer_cubins(args.artifacts)
    if real is not None:
        origin_root, artifacts = real
        source = f"{len(artifacts)} real cubins from flashinfer-cubin"
    else:
        origin_root = work / "origin"
        artifacts = make_artifacts(origin_root, args.artifacts, seed=7)
        source = f"{len(artifacts)} generated artifacts of cubin sizes (50-600 KB)"
    manifest = work / "manifest.txt"
    manifest.write_text(manifest_text(artifacts))
    total = sum((origin_root / a.name).stat().st_size for a in artifacts)
    print(f"demo: {source}, {_mib(total)}; {args.ranks} ranks on {args.nodes} simulated "
          f"nodes, one pool per node under {work / 'pools'}")

    with LoopbackOrigin(origin_root, latency=args.latency) as origin:
        print(f"demo: loopback origin at {origin.url} ({args.latency * 1000:.0f} ms per request)")
        results = []
        for n, title in ((1, "cold start"), (2, "warm start")):
            before, before_bytes = origin.total_requests, origin.bytes_sent
            data = _run_job(args, work, origin.url, manifest, n)
            reqs = origin.total_requests - before
            _print_run(n, title, data, reqs, origin.bytes_sent - before_bytes)
            results.append((data, reqs))

    (cold, cold_reqs), (warm, warm_reqs) = results
    k = len(artifacts)
    per_node = args.ranks // args.nodes
    opens_ok = all(
        len(r["opens"]) == per_node - 1 and all(v == 1 for v in r["opens"].values())
        for d in (cold, warm) for r in d["ranks"]
    )
    checks = [
        (f"run 1: {k} downloads for {args.ranks} ranks", cold["prefetch"]["downloads"] == k
         and cold_reqs == k),
        ("run 2: 0 downloads (warm pools)", warm["prefetch"]["downloads"] == 0 and warm_reqs == 0),
        ("IPC: every consumer opened each peer pool on its node exactly once", opens_ok),
        ("IPC: every feature resolved with the right values",
         all(r["checked"] == r["resolved"] > 0 for d in (cold, warm) for r in d["ranks"])),
    ]
    print()
    for label, ok in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {label}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
