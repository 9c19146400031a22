"""``init`` where FlashInfer is not imported yet: its install beside the prefetch, or after it.

    python -m scripts.bench_install_beside [--repeat 3] [--out docs/bench]

An engine hook may call ``distcache.init`` before the engine imports FlashInfer; the
FlashInfer integration's install then imports it (with torch already loaded, as in an
engine). A foreground ``init`` installs it on a thread while the start-up prefetch
runs (``install_beside_prefetch``, :mod:`distcache._beside`); the baseline is the same
integration installed after the prefetch (a subclass that does not opt in), as every
install was before. Each launch is a fresh process (one rank): ``import torch``
outside the clock, then the clock runs through ``import distcache`` and
``distcache.init(manifests=[M])`` on a cold pool, K artifacts from a loopback origin
answering each request after ``--latency`` seconds. The two kinds alternate
``--repeat`` times; each row is the median launch.

Writes ``OUT/install_beside.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("beside", "after")


def worker(kind: str, work: Path, url: str) -> None:
    import torch  # noqa: F401  (the engine's import, before the clock)

    assert "flashinfer" not in sys.modules
    began = time.perf_counter()
    import distcache
    from distcache.integrations.flashinfer import FlashInfer

    class After(FlashInfer):
        install_beside_prefetch = False

    chosen = FlashInfer() if kind == "beside" else After()
    session = distcache.init(pool=work / f"pool-{kind}", origin=url,
                             manifests=[str(work / "manifest.txt")], integrations=[chosen])
    init_s = time.perf_counter() - began
    report = session.report
    print(json.dumps({"kind": kind, "init_s": init_s, "phases": dict(session.phases),
                      "downloads": 0 if report is None else report.downloads,
                      "installed": [i.name for i in session.integrations]}))
    session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--artifacts", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.work, args.url)
        return
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    from distcache.artifact import manifest_text
    from distcache.testing import LoopbackOrigin, make_artifacts

    work = Path(tempfile.mkdtemp(prefix="bench-beside-"))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    try:
        artifacts = make_artifacts(work / "origin", args.artifacts, min_size=50_000,
                                   max_size=200_000)
        (work / "manifest.txt").write_text(manifest_text(artifacts))
        env = {**os.environ, "XDG_CACHE_HOME": str(work / "xdg"),
               "FLASHINFER_CUBIN_DIR": str(work / "cubins")}
        for var in ("DISTCACHE_POOL", "DISTCACHE_ORIGIN", "DISTCACHE_DISABLE"):
            env.pop(var, None)
        with LoopbackOrigin(work / "origin", latency=args.latency) as server:
            for k in range(args.repeat):
                for kind in KINDS:
                    shutil.rmtree(work / f"pool-{kind}", ignore_errors=True)
                    done = subprocess.run(
                        [sys.executable, "-m", "scripts.bench_install_beside", "--worker",
                         kind, "--work", str(work), "--url", server.url],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
                    if done.returncode != 0:
                        sys.stderr.write(done.stderr[-4000:])
                        raise SystemExit(f"{kind} launch {k} failed ({done.returncode})")
                    run = json.loads(done.stdout.strip().splitlines()[-1])
                    if run["downloads"] != args.artifacts or run["installed"] != ["flashinfer"]:
                        raise SystemExit(f"{kind} launch {k}: {run}")
                    timed_as = "flashinfer:beside" if kind == "beside" else "flashinfer"
                    if timed_as not in run["phases"]:  # installed the other way
                        raise SystemExit(f"{kind} launch {k}: no phase {timed_as!r} in "
                                         f"{sorted(run['phases'])}")
                    runs[kind].append(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for kind in KINDS:
        median = sorted(runs[kind], key=lambda r: r["init_s"])[(args.repeat - 1) // 2]
        rows.append({"install": kind, "init_s": round(median["init_s"], 3),
                     "init_runs_s": [round(r["init_s"], 3) for r in runs[kind]],
                     "prefetch_s": round(median["phases"]["prefetch"], 3),
                     "flashinfer_install_s": round(median["phases"][
                         "flashinfer:beside" if kind == "beside" else "flashinfer"], 3)})
    ratio = rows[0]["init_s"] / rows[1]["init_s"]
    print(f"{'install':<8} {'init s':>7} {'prefetch s':>10} {'install s':>9}  runs")
    for row in rows:
        print(f"{row['install']:<8} {row['init_s']:>7.3f} {row['prefetch_s']:>10.3f} "
              f"{row['flashinfer_install_s']:>9.3f}  {row['init_runs_s']}")
    print(f"beside the prefetch: {ratio:.2f}x the init of the install after it")
    result = {"benchmark": "bench_install_beside",
              "what": "1 rank, import torch before the clock; import distcache + "
                      "distcache.init(manifests=[M]) with FlashInfer not yet imported, its "
                      "install beside the prefetch against after it; cold pool",
              "artifacts": args.artifacts, "latency_s": args.latency,
              "repeat": args.repeat, "cores": os.cpu_count(), "rows": rows,
              "beside_over_after": round(ratio, 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "install_beside.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out / 'install_beside.json'}")


if __name__ == "__main__":
    main()
