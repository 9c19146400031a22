#!/usr/bin/env python
"""Compare ways of getting K artifacts onto N ranks, as real MPI processes, against a
loopback origin with per-request latency and an aggregate bandwidth cap.

Strategies (each rank uses the same download concurrency, ``--downloads-per-rank``):

  per-rank     (a) every rank checks, then downloads into its own directory
               (FlashInfer's default: N x K origin requests)
  shared-dir   (b) one shared directory, no coordination: check, download to a temp
               file, rename; every rank that misses downloads
  lazy-fetch   (c) one shared ArtifactPool; every rank calls pool.fetch for every
               artifact (read-through with a per-object lock)
  prefetch     (d) distcache.prefetch into the node's pool (one node here, so the
               node-local pool is the shared one), collectively
  warm         (e) distcache.prefetch again on the warm pool of (d)
  fi-per-rank  (f) FlashInfer's real loader (``flashinfer.jit.cubin_loader.get_artifact``)
               with one FLASHINFER_CUBIN_DIR per rank (TensorRT-LLM's per-rank slots)
  fi-per-node  (g) FlashInfer's real loader with one directory per node (its default:
               ranks of a node share it behind FlashInfer's own file lock)
  engine       (h) prefetch + kernel loads on 2 simulated nodes with node-local pools:
               distcache.prefetch (so the broadcast between nodes is exercised),
               then every rank loads every kernel through FlashInfer's loader with
               distcache's wrapper installed. Not an engine start-up: the clock starts
               after ``import distcache``, the communicator and the wrapper's install
               (see (j) for a start-up timed from the import)
  engine-warm  (i) the same again on the warm pools
  engine-init  (j) the engine start-up a user meets, on 2 simulated nodes: after the
               engine's own imports (mpi4py, i.e. MPI_Init, torch, FlashInfer; timed
               apart), ``import distcache``, ``distcache.init(manifests=[M])`` with its
               default integrations (init installs FlashInfer's wrapper) and node-local
               pools (DISTCACHE_POOL, DISTCACHE_NODE_ID), then every rank loads every
               kernel through FlashInfer's loader; ready when the slowest rank is
  engine-init-warm
               (k) the same again on the warm pools and cubin directories of (j)

(f)-(k) need FlashInfer (``flashinfer-python``) and are skipped without it; (g)-(k)
put ranks ``[0, N/2)`` on node 0 and the rest on node 1. (j) and (k) are given
against the latency floor of the same run, ceil(K / concurrent downloads) x the
request latency measured at its start, with the phases of the slowest rank: import,
init's (``Session.phases``), its prefetch's (``report.seconds``) and the loads. The loaders use the same
download concurrency per rank as every other strategy (FlashInfer's own bulk download
uses 4 threads, ``FLASHINFER_CUBIN_DOWNLOAD_THREADS``).

Baselines are one process fetching the K artifacts once: at the total concurrency of
the N ranks (N x --downloads-per-rank threads: the fair comparison for N) and at
FlashInfer's 4 threads. Every row is also given as a ratio to the physical floor at
its concurrency, ceil(K / concurrent downloads) x latency + bytes / bandwidth.

The driver (this script without ``--worker``) writes the artifacts, runs the origin
and reads its counters; for every N and strategy it launches ``mpirun -n N`` of this
script with ``--worker`` (a fresh set of processes, so peak RSS is per strategy).
Wall time is barrier to barrier, the maximum over ranks; it excludes process start-up,
imports (distcache's and the HTTP stack's, for every strategy and baseline alike) and
the first use of the communicator (a job has its process group up before it fetches
kernels), which are reported separately as start-up. Every cell (each
baseline too) is run ``--repeat`` times (default 3) and the run with the median wall
time is reported, with every run's wall time and origin requests beside it; a request
target holds only if it holds in every run. A rank that misses an artifact or is served
wrong bytes makes its row incomplete: no target read from it holds, and the run exits
with an error naming the row, without writing its results. It also measures the cost
parameters ``scripts/scale_model.py`` reads. Writes ``bench_prefetch.json`` and
``bench_prefetch.png`` to --out (``--name`` names them otherwise) and prints a table
and the targets. It compiles distcache's sources first (``compileall``): an installed
package has its bytecode, and (j) and (k) time its import.

    python -m scripts.bench_prefetch --out bench-results/
    python -m scripts.bench_prefetch --strategies engine-init,engine-init-warm --ranks 4 \
        --name engine_startup      # docs/bench/engine_startup.json: rows (j) and (k)

``BENCH_PROFILE_DIR=DIR`` writes each rank's cProfile of its timed part there.

Run it from the repository root, as a module: it starts its ranks with the test
harness's process runner (:mod:`tests.support.process`), which is importable from
there and is not part of the installed library.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

# distcache is imported where it is used, not here: the engine start-up rows (j) and
# (k) time ``import distcache`` itself, so their ranks must not have imported it yet.
if TYPE_CHECKING:
    from distcache import HttpOrigin
    from distcache.artifact import Artifact
    from distcache.comm import Communicator

try:
    from tests.support.process import mpirun, run_group
except ModuleNotFoundError as exc:
    if exc.name != "tests":
        raise
    raise SystemExit("run this from the repository root: python -m scripts.bench_prefetch ...") from None

#: The repository root: the ranks run ``-m scripts.bench_prefetch`` from there.
ROOT = Path(__file__).resolve().parents[1]

STRATEGIES = ("per-rank", "shared-dir", "lazy-fetch", "prefetch", "warm", "fi-per-rank",
              "fi-per-node", "engine", "engine-warm", "engine-init", "engine-init-warm")
#: The engine start-up as a user meets it: ``import distcache`` and ``distcache.init``
#: timed with the kernel loads (see engine_init_worker).
ENGINE_INIT = ("engine-init", "engine-init-warm")
FLASHINFER = ("fi-per-rank", "fi-per-node", "engine", "engine-warm", *ENGINE_INIT)
TWO_NODES = ("fi-per-node", "engine", "engine-warm", *ENGINE_INIT)
#: The warm rows: they download nothing, so no download floor applies to them and
#: they carry no ratio to one (the warm engine start-up has its own target, below).
WARM = ("warm", "engine-warm", "engine-init-warm")
#: The engine's warm start-up target at 2x2, in seconds.
ENGINE_WARM_TARGET_S = 0.25
#: FlashInfer's bulk download concurrency (FLASHINFER_CUBIN_DOWNLOAD_THREADS default).
FLASHINFER_THREADS = 4
LABELS = {
    "per-rank": "(a) per-rank dirs",
    "shared-dir": "(b) shared dir, no coordination",
    "lazy-fetch": "(c) lazy pool.fetch",
    "prefetch": "(d) distcache prefetch",
    "warm": "(e) distcache warm start",
    "fi-per-rank": "(f) FlashInfer, dir per rank",
    "fi-per-node": "(g) FlashInfer, dir per node",
    "engine": "(h) prefetch + kernel loads, 2 nodes",
    "engine-warm": "(i) prefetch + kernel loads, warm",
    "engine-init": "(j) engine start-up through init",
    "engine-init-warm": "(k) engine start-up, warm",
}
BASELINE = "baseline"
BCAST = "bcast"
# A run that takes longer than this is broken, not slow.
WORKER_TIMEOUT_S = 180.0


# -- the strategies (run on every rank of a worker) -------------------------------------


def _download_file(directory: Path, artifact: Artifact, origin: HttpOrigin) -> None:
    """Check, then download to a process-unique temp file and rename into place."""
    dest = directory / artifact.name
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            origin.fetch_into(artifact, out)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _files_present(directory: Path, arts: list[Artifact]) -> bool:
    return all((directory / a.name).is_file() for a in arts)


def _served_right(served: dict[str, bytes], arts: list[Artifact]) -> bool:
    """Whether a loader returned every artifact's exact bytes. Checked after the
    timed barrier, for every loader alike: the loaders verify what they serve
    themselves, and this check is the harness's, not part of a start-up."""
    return all(hashlib.sha256(served.get(a.name, b"")).hexdigest() == a.sha256 for a in arts)


def _in_threads(fn: Callable[[Artifact], object], arts: list[Artifact], threads: int) -> None:
    with ThreadPoolExecutor(threads) as ex:
        for _ in ex.map(fn, arts):
            pass


def run_strategy(
    strategy: str, comm: Communicator, arts: list[Artifact], url: str, run_dir: Path, threads: int
) -> tuple[Callable[[], bool], dict[str, Any]]:
    """Make the artifacts ready on this rank; returns a completeness check and extras."""
    from distcache import ArtifactPool, HttpOrigin, prefetch

    began = time.perf_counter()
    origin = HttpOrigin(url, retries=0)
    if strategy in (BASELINE, "per-rank"):
        own = run_dir / f"rank{comm.rank}"
        _in_threads(lambda a: _download_file(own, a, origin), arts, threads)
        return (lambda: _files_present(own, arts)), {}
    if strategy == "shared-dir":
        shared = run_dir / "shared"
        _in_threads(lambda a: _download_file(shared, a, origin), arts, threads)
        return (lambda: _files_present(shared, arts)), {}
    if strategy == "lazy-fetch":
        pool = ArtifactPool(run_dir / "lazy-pool")
        _in_threads(lambda a: pool.fetch(a, origin), arts, threads)
        return (lambda: all(pool.has(a.sha256) for a in arts)), {}
    if strategy in ("fi-per-rank", "fi-per-node"):
        loader = _flashinfer_loader()
        served: dict[str, bytes] = {}

        def get(a: Artifact) -> None:
            served[a.name] = loader.get_artifact(a.name, a.sha256)

        _in_threads(get, arts, threads)
        where = Path(os.environ["FLASHINFER_CUBIN_DIR"])
        return (lambda: _files_present(where, arts) and _served_right(served, arts)), {}
    if strategy in ("engine", "engine-warm"):
        from distcache.integrations import flashinfer as fi

        loader = _flashinfer_loader()
        pool = ArtifactPool(run_dir / f"engine-pool-{comm.node_id}")
        t0 = time.perf_counter()
        report = prefetch(arts, comm=comm, pool=pool, origin=origin, downloads_per_rank=threads)
        t2 = t1 = time.perf_counter()

        served = {}

        def load(a: Artifact) -> None:
            served[a.name] = loader.get_artifact(a.name, a.sha256)

        _in_threads(load, arts, threads)
        t3 = time.perf_counter()
        extras = {"report_seconds": dict(report.seconds), "downloads": report.downloads,
                  "engine_s": {"prefetch": t1 - t0, "load": t3 - t2},
                  "downloaders": len(report.downloaders), "broadcasts": report.broadcasts,
                  "pool_hits": report.pool_hits, "open_s": 0.0}

        def complete() -> bool:
            fi.uninstall()  # the engine is ready: taking the wrapper out is not timed
            return all(pool.has(a.sha256) for a in arts) and _served_right(served, arts)

        return complete, extras
    if strategy in ("prefetch", "warm"):
        pool = ArtifactPool(run_dir / "pool")  # warm: the pool prefetch filled
        open_s = time.perf_counter() - began
        report = prefetch(arts, comm=comm, pool=pool, origin=origin,
                                    downloads_per_rank=threads)
        extras = {
            "report_seconds": dict(report.seconds),
            "downloads": report.downloads,
            "downloaders": len(report.downloaders),
            "broadcasts": report.broadcasts,
            "pool_hits": report.pool_hits,
            "open_s": open_s,
        }
        return (lambda: all(pool.has(a.sha256) for a in arts)), extras
    raise ValueError(f"unknown strategy {strategy!r}")


def _start_profile() -> Any:
    """A running cProfile profiler when ``BENCH_PROFILE_DIR`` is set, else ``None``."""
    if not os.environ.get("BENCH_PROFILE_DIR"):
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _stop_profile(profiler: Any, name: str) -> None:
    """Write ``profiler``'s figures as ``BENCH_PROFILE_DIR/NAME.pstats``."""
    if profiler is None:
        return
    profiler.disable()
    where = os.environ["BENCH_PROFILE_DIR"]
    os.makedirs(where, exist_ok=True)
    profiler.dump_stats(os.path.join(where, f"{name}.pstats"))


def _flashinfer_loader() -> Any:
    """FlashInfer's loader module, imported after its variables are set."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as loader
    return loader


def node_of(rank: int, size: int, strategy: str) -> str | None:
    """The simulated node of ``rank`` for the two-node strategies, else None."""
    if strategy not in TWO_NODES:
        return None
    return f"node{rank * 2 // size}" if size > 1 else "node0"


def prepare(strategy: str, rank: int, size: int, run_dir: Path, url: str) -> None:
    """What a FlashInfer strategy sets before FlashInfer is imported (untimed)."""
    if strategy not in FLASHINFER:
        return
    from distcache import ArtifactPool, HttpOrigin

    where = f"rank{rank}" if strategy == "fi-per-rank" else node_of(rank, size, strategy)
    if strategy in ("engine", "engine-warm"):
        where = f"engine-rank{rank}"
    os.environ["FLASHINFER_CUBIN_DIR"] = str(run_dir / f"fi-{where}")
    os.environ["FLASHINFER_CUBINS_REPOSITORY"] = url
    _flashinfer_loader()
    if strategy in ("engine", "engine-warm"):
        # An engine installs the wrapper when it starts (DISTCACHE_AUTOINSTALL), before
        # it loads any kernel; FlashInfer's own import is untimed for (f) and (g) too.
        from distcache.integrations import flashinfer as fi

        pool = ArtifactPool(run_dir / f"engine-pool-{node_of(rank, size, strategy)}")
        fi.install(pool, HttpOrigin(url, retries=0))


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


def load_artifacts(mirror: Path) -> list[Artifact]:
    from distcache.artifact import Artifact, parse_checksums

    arts = parse_checksums((mirror / "checksums.txt").read_text())
    return [Artifact(a.name, a.sha256, (mirror / a.name).stat().st_size) for a in arts]


def worker(args: argparse.Namespace) -> None:
    """One rank of one mpirun: time the strategy barrier to barrier, gather to rank 0."""
    from mpi4py import MPI

    import distcache.comm

    world = MPI.COMM_WORLD
    node = node_of(world.Get_rank(), world.Get_size(), args.worker)
    comm = distcache.comm.from_mpi(node_id=node)
    arts = load_artifacts(args.mirror)
    prepare(args.worker, comm.rank, comm.size, args.run_dir, args.url)
    # Imports are start-up, not fetching: every strategy and baseline starts the clock
    # with distcache's modules and the HTTP stack (requests, urllib3) loaded, as an
    # engine has them (FlashInfer imports requests) when it fetches kernels.
    from distcache import ArtifactPool, HttpOrigin, prefetch  # noqa: F401

    HttpOrigin(args.url).prepare()
    if args.worker == BCAST:
        figures = measure_broadcast(comm)
        if comm.rank == 0:
            args.result.write_text(json.dumps(figures))
        return
    # A job's process group is up and has been used before it fetches kernels: the
    # first collectives of each kind (MPI connects peers lazily) run before timing.
    comm.allgather_object(comm.rank)
    comm.broadcast_bytes(b"x" if comm.rank == 0 else None, 0)
    comm.barrier()
    # Start-up: from the driver's launch to this rank's readiness to start.
    startup = time.time() - args.launched_at
    comm.barrier()
    profiler = _start_profile()
    start = time.perf_counter()
    complete, extras = run_strategy(
        args.worker, comm, arts, args.url, args.run_dir, args.downloads_per_rank
    )
    seconds = time.perf_counter() - start
    _stop_profile(profiler, f"{args.worker}-n{comm.size}-rank{comm.rank}")
    comm.barrier()
    wall = time.perf_counter() - start
    if args.worker == "warm":
        # What a warm prefetch cannot beat: its three allgathers of small objects,
        # barrier to barrier, on the same processes.
        comm.barrier()
        floor_start = time.perf_counter()
        for _ in range(3):
            comm.allgather_object((comm.rank, "x" * 64))
        comm.barrier()
        extras["collective_floor_s"] = time.perf_counter() - floor_start
    mine = {
        "wall_s": wall,
        "own_s": seconds,
        "startup_s": startup,
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "complete": complete(),
        **extras,
    }
    gathered = comm.allgather_object(mine)
    if comm.rank == 0:
        args.result.write_text(json.dumps(gathered))


def engine_kernels(mirror: Path) -> list[tuple[str, str]]:
    """``(name, sha256)`` of every kernel, as an engine's code pins them; read without
    distcache, whose import the engine start-up rows time."""
    pairs = []
    for line in (mirror / "checksums.txt").read_text().splitlines():
        if line.strip():
            sha, name = line.split(maxsplit=1)
            pairs.append((name.strip(), sha))
    return pairs


def _barrier_sleeping(world: Any) -> None:
    """A barrier on an mpi4py communicator that sleeps while it waits: MPI's own spins,
    and on a machine with fewer cores than ranks a rank that is ready would take CPU
    from the ones that are not (on a real node every rank has its own core)."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)


def engine_init_worker(args: argparse.Namespace) -> None:
    """One rank of an engine starting up through ``distcache.init`` (j, k).

    Before the clock, the imports the engine makes for itself: mpi4py (``MPI_Init``),
    torch and FlashInfer, with FlashInfer's variables set first (a cubin directory per
    rank, the loopback origin as its repository); the engine's world communicator has
    been used once. On the clock: ``import distcache``, ``distcache.init(manifests=[M])``
    with its default integrations (FlashInfer's wrapper is installed by init) and a
    node-local pool (``DISTCACHE_POOL``, ``DISTCACHE_NODE_ID``), then every kernel
    loaded through FlashInfer's ``get_artifact``; it stops when the slowest rank is
    ready (barrier to barrier). Warm: the same on the pools and cubin directories the
    cold run of this repetition filled.
    """
    began = time.perf_counter()
    import warnings

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    node = node_of(rank, size, args.worker)
    os.environ.update({
        "FLASHINFER_CUBIN_DIR": str(args.run_dir / f"fi-engine-init-rank{rank}"),
        "FLASHINFER_CUBINS_REPOSITORY": args.url,
        "DISTCACHE_POOL": str(args.run_dir / f"engine-init-pool-{node}"),
        "DISTCACHE_NODE_ID": str(node),
        "DISTCACHE_DOWNLOADS_PER_RANK": str(args.downloads_per_rank),
    })
    import torch  # noqa: F401  (the engine's own import, untimed)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer  # noqa: F401
        import flashinfer.jit.cubin_loader as loader
    kernels = engine_kernels(args.mirror)
    if any(name == "distcache" or name.startswith("distcache.") for name in sys.modules):
        raise SystemExit("distcache was imported before the engine start-up's clock")
    world.allgather(rank)
    world.Barrier()
    imports_s = time.perf_counter() - began
    startup = time.time() - args.launched_at
    _barrier_sleeping(world)
    profiler = _start_profile()
    start = time.perf_counter()
    cpu_start = time.process_time()
    import distcache

    imported = time.perf_counter()
    session = distcache.init(manifests=[str(args.mirror / "checksums.txt")])
    initialised = time.perf_counter()
    served: dict[str, bytes] = {}

    def load(kernel: tuple[str, str]) -> None:
        served[kernel[0]] = loader.get_artifact(*kernel)

    with ThreadPoolExecutor(args.downloads_per_rank) as ex:
        for _ in ex.map(load, kernels):
            pass
    ready = time.perf_counter()
    cpu = time.process_time() - cpu_start
    _stop_profile(profiler, f"{args.worker}-n{size}-rank{rank}")
    _barrier_sleeping(world)
    wall = time.perf_counter() - start
    from distcache._beside import BESIDE  # after the clock

    report = session.report
    complete = all(hashlib.sha256(served.get(name, b"")).hexdigest() == sha
                   for name, sha in kernels)
    mine = {
        "wall_s": wall,
        "own_s": ready - start,
        "startup_s": startup,
        "imports_s": imports_s,
        # This rank's CPU seconds (every thread) until it was ready: the ranks' sum
        # over the machine's cores bounds the wall time where ranks share cores.
        "cpu_s": cpu,
        "engine_s": {"import": imported - start, "init": initialised - imported,
                     # What init spends outside its named phases: the modules it
                     # imports and choosing the integrations (the peer agents' start is
                     # the phase "peers"; an install beside the prefetch overlaps it).
                     "init_unphased": initialised - imported - sum(
                         v for k, v in session.phases.items() if not k.endswith(BESIDE)),
                     "load": ready - initialised},
        "init_phases": dict(session.phases),
        "report_seconds": dict(report.seconds) if report is not None else {},
        "downloads": report.downloads if report is not None else 0,
        "downloaders": len(report.downloaders) if report is not None else 0,
        "pool_hits": report.pool_hits if report is not None else 0,
        "integrations": [i.name for i in session.integrations],
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "complete": complete and "flashinfer" in [i.name for i in session.integrations],
    }
    session.close()
    gathered = world.gather(mine, root=0)
    if rank == 0:
        args.result.write_text(json.dumps(gathered))


# -- the driver ---------------------------------------------------------------------------


def mpirun_command(n: int) -> list[str]:
    found = mpirun()
    if shutil.which(found) is None:
        raise SystemExit("mpirun not found (install openmpi or the mpi4py wheel's)")
    # 8 ranks on a 2-core machine: oversubscribe, and let the kernel place them.
    return [found, "-n", str(n), "--oversubscribe", "--bind-to", "none"]


def launch(
    n: int, strategy: str, common: list[str], run_dir: Path, result: Path
) -> tuple[Any, float]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    launched = time.time()
    cmd = [
        *mpirun_command(n), sys.executable, "-m", "scripts.bench_prefetch",
        "--worker", strategy, "--run-dir", str(run_dir), "--result", str(result),
        "--launched-at", repr(launched), *common,
    ]
    try:
        done = run_group(cmd, timeout=WORKER_TIMEOUT_S, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        sys.stderr.write("".join(p for p in (exc.output, exc.stderr) if isinstance(p, str)))
        raise SystemExit(f"mpirun -n {n} {strategy} did not finish in {WORKER_TIMEOUT_S} s; "
                         "killed it and its ranks") from None
    elapsed = time.time() - launched
    if done.returncode != 0 or not result.exists():
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"mpirun -n {n} {strategy} failed with status {done.returncode}")
    return json.loads(result.read_text()), elapsed


def measure_origin(origin: HttpOrigin, arts: list[Artifact], reps: int = 7,
                   rounds: int = 4) -> dict[str, float]:
    """Per-request latency (smallest artifact) and per-connection bandwidth (largest).

    The largest artifact takes a few milliseconds longer than the smallest, less than
    the jitter of one 100 ms request, so one sample of it against the latency can
    come out shorter than the latency (bandwidth then divides by ~0). Interleaved
    repetitions and the difference of medians keep both figures from one sample;
    where the medians of ``reps`` pairs still do not differ, ``reps`` more pairs are
    taken, up to ``rounds`` times, before the measurement is given up.
    """
    small = min(arts, key=lambda a: a.size or 0)
    big = max(arts, key=lambda a: a.size or 0)
    nbytes = (big.size or 0) - (small.size or 0)
    lat: list[float] = []
    full: list[float] = []
    for _ in range(rounds):
        for _ in range(reps):
            for artifact, into in ((small, lat), (big, full)):
                t = time.perf_counter()
                origin.fetch(artifact)
                into.append(time.perf_counter() - t)
        latency = statistics.median(lat)
        extra = statistics.median(full) - latency
        if extra > 0:
            return {"request_latency_s": latency, "origin_bandwidth_Bps": nbytes / extra}
    raise SystemExit(
        f"cannot measure the origin bandwidth: over {len(lat)} interleaved requests, "
        f"{big.name} ({big.size} bytes) took no longer than {small.name} ({small.size} "
        "bytes); use more or larger artifacts"
    )


def summarize(strategy: str, n: int, ranks: list[dict[str, Any]], stats: dict[str, Any],
              launch_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "strategy": strategy,
        "ranks": n,
        "origin_requests": stats["total_requests"],
        "origin_bytes": stats["bytes_sent"],
        "wall_s": max(r["wall_s"] for r in ranks),
        "peak_rss_bytes": max(r["maxrss_bytes"] for r in ranks),
        "startup_s": max(r["startup_s"] for r in ranks),
        "launch_s": launch_s,
        "complete": all(r["complete"] for r in ranks),
    }
    if "init_phases" in ranks[0]:
        # The slowest rank's figure of each phase (phases of init, of its prefetch).
        for key, into in (("init_phases", "init_phases"), ("report_seconds", "phase_seconds")):
            names = dict.fromkeys(k for r in ranks for k in r[key])
            row[into] = {k: max(r[key].get(k, 0.0) for r in ranks) for k in names}
        row["imports_s"] = max(r["imports_s"] for r in ranks)
        row["cpu_s_per_rank"] = [r["cpu_s"] for r in ranks]
        # Each rank's own figures: which rank is the slowest, and where it waited.
        row["engine_s_per_rank"] = [r["engine_s"] for r in ranks]
        row["init_phases_per_rank"] = [r["init_phases"] for r in ranks]
        row["downloaders"] = ranks[0]["downloaders"]
        row["pool_hits"] = ranks[0]["pool_hits"]
        row["integrations"] = ranks[0]["integrations"]
    elif "report_seconds" in ranks[0]:
        row["phase_seconds"] = ranks[0]["report_seconds"]
        row["downloaders"] = ranks[0]["downloaders"]
        row["pool_hits"] = ranks[0]["pool_hits"]
        row["open_pool_s"] = max(r["open_s"] for r in ranks)
    if "engine_s" in ranks[0]:
        row["engine_s"] = {k: max(r["engine_s"][k] for r in ranks) for k in ranks[0]["engine_s"]}
    if "collective_floor_s" in ranks[0]:
        row["collective_floor_s"] = max(r["collective_floor_s"] for r in ranks)
    return row


def driver(args: argparse.Namespace) -> None:
    from distcache import HttpOrigin
    from distcache.testing import LoopbackOrigin, make_artifacts

    began = time.perf_counter()
    load_before = os.getloadavg()[0]
    # An installed distcache has its bytecode: rows (j) and (k) time its import.
    subprocess.run([sys.executable, "-m", "compileall", "-q", "distcache", "launch"],
                   cwd=ROOT, check=True)
    ranks_axis = sorted({int(x) for x in args.ranks.split(",") if x})
    strategies = [s for s in STRATEGIES if s in args.strategies.split(",")]
    if not _has_flashinfer():
        skipped = [s for s in strategies if s in FLASHINFER]
        if skipped:
            print(f"FlashInfer is not installed: skipping {', '.join(skipped)}")
        strategies = [s for s in strategies if s not in FLASHINFER]
    baselines: dict[int, dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-prefetch-"))
    mirror = work / "mirror"
    make_artifacts(mirror, args.artifacts, min_size=args.min_size, max_size=args.max_size)
    arts = load_artifacts(mirror)
    total_bytes = sum(a.size or 0 for a in arts)
    rows: list[dict[str, Any]] = []
    try:
        with LoopbackOrigin(mirror, latency=args.latency, bandwidth=args.bandwidth) as server:
            common = ["--mirror", str(mirror), "--url", server.url,
                      "--downloads-per-rank", str(args.downloads_per_rank)]
            measured = measure_origin(HttpOrigin(server.url, retries=0), arts)
            # Per-hop broadcast cost: the scale model multiplies by the tree depth.
            bcast, _ = launch(2, BCAST, common, work / "bcast", work / "bcast.json")
            measured.update(bcast)

            def one_run(n: int, strategy: str, argv: list[str], concurrent: int,
                        run_dir: Path, result: Path | None = None) -> dict[str, Any]:
                """One mpirun of ``strategy`` on ``n`` ranks, as a row with its floor."""
                server.reset()
                # Nothing of the launch before is still being written back: a warm start
                # is a later launch, not one racing the cold one's writeback (the same
                # for every strategy and for the baselines).
                os.sync()
                ranks, launch_s = launch(n, strategy, argv, run_dir,
                                         (result or run_dir).with_suffix(".json"))
                row = summarize(strategy, n, ranks, server.stats(), launch_s)
                if strategy in ENGINE_INIT and strategy not in WARM:
                    # The latency floor of this run: the K requests at the measured
                    # per-request latency, ``concurrent`` at a time.
                    floor = (math.ceil(args.artifacts / concurrent)
                             * measured["request_latency_s"])
                    row.update(latency_floor_s=floor, vs_latency_floor=row["wall_s"] / floor)
                return with_floor(row, concurrent, args, total_bytes)

            def with_threads(threads: int) -> list[str]:
                return ["--mirror", str(mirror), "--url", server.url,
                        "--downloads-per-rank", str(threads)]

            # One process fetching the set once: at FlashInfer's 4 threads, and at the
            # total concurrency of each N (the fair comparison for N ranks).
            for threads in sorted({FLASHINFER_THREADS,
                                   *(n * args.downloads_per_rank for n in ranks_axis)}):
                runs = [one_run(1, BASELINE, with_threads(threads), threads,
                                work / f"baseline{threads}-{rep}")
                        for rep in range(args.repeat)]
                baselines[threads] = median_run(runs)
                print_row(baselines[threads], header=len(baselines) == 1)
            # Each repetition runs every strategy in order on fresh directories (warm
            # rows reuse the pools their cold row filled in the same repetition).
            cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
            for n in ranks_axis:
                for rep in range(args.repeat):
                    run_dir = work / f"n{n}-{rep}"
                    for strategy in strategies:
                        if strategy in TWO_NODES and n < 2:
                            continue
                        cells.setdefault((n, strategy), []).append(
                            one_run(n, strategy, common, n * args.downloads_per_rank,
                                    run_dir, work / f"n{n}-{rep}-{strategy}"))
                for strategy in strategies:
                    if (n, strategy) in cells:
                        rows.append(median_run(cells[n, strategy]))
                        print_row(rows[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    baseline = baselines[FLASHINFER_THREADS]
    targets = check_targets(rows, baselines, args, total_bytes)
    print("measured: " + ", ".join(f"{k}={v:.3g}" for k, v in measured.items()))
    for row in rows:
        if "init_phases" in row:
            print(engine_init_line(row))
        elif "phase_seconds" in row:
            phases = " ".join(f"{p} {s:.3f}" for p, s in row["phase_seconds"].items())
            print(f"{LABELS[row['strategy']]} N={row['ranks']} phases (max over ranks): "
                  f"open {row['open_pool_s']:.3f} {phases}"
                  + (f"; 3 bare allgathers take {row['collective_floor_s']:.3f}"
                     if "collective_floor_s" in row else ""))
    print("start-up (mpirun launch to the first timed barrier) is excluded from wall s: "
          f"{min(r['startup_s'] for r in rows):.1f}-{max(r['startup_s'] for r in rows):.1f} s "
          f"per launch here (baseline {baseline['startup_s']:.1f} s)")
    for target in targets:
        print(f"target {'HOLDS' if target['holds'] else 'FAILS'}: {target['target']}: "
              f"{target['observed']}")
    print(f"benchmark took {time.perf_counter() - began:.0f} s")
    incomplete = [r for r in [*baselines.values(), *rows] if not r["complete"]]
    if incomplete:
        # A rank missed an artifact or was served wrong bytes: its wall time is not the
        # time to have the artifacts, so nothing of this run is written.
        raise SystemExit(
            "incomplete (an artifact missing or served with wrong bytes in some run): "
            + ", ".join(f"{row_label(r)} N={r['ranks']}" for r in incomplete)
            + f"; {args.out / args.name}.json/.png not written"
        )
    write_results(args, total_bytes, measured, baselines, rows, targets, load_before)


def engine_init_line(row: dict[str, Any]) -> str:
    """Where an engine start-up through init (j, k) spent its time, slowest rank's."""
    def listed(figures: dict[str, float]) -> str:
        return " ".join(f"{k} {v:.3f}" for k, v in figures.items())

    eng = row["engine_s"]
    floor = (f" = {row['vs_latency_floor']:.2f}x the latency floor "
             f"{row['latency_floor_s']:.3f} s" if "vs_latency_floor" in row else "")
    return (f"{LABELS[row['strategy']]} N={row['ranks']}: ready {row['wall_s']:.3f} s{floor}; "
            f"engine imports before the clock {row['imports_s']:.2f} s; import distcache "
            f"{eng['import']:.3f}, init {eng['init']:.3f} ({listed(row['init_phases'])} "
            f"outside them {eng['init_unphased']:.3f}; "
            f"prefetch: {listed(row['phase_seconds'])}), load {eng['load']:.3f}; CPU s per "
            f"rank {' '.join(f'{c:.3f}' for c in row['cpu_s_per_rank'])}; init+load per rank "
            + " ".join("{init:.3f}+{load:.3f}".format(**e) for e in row["engine_s_per_rank"]))


def _has_flashinfer() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (the upper one of an even count), with every
    run's wall time beside it; every row is complete only if every run was."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    chosen = ordered[len(ordered) // 2]
    return {**chosen, "wall_s_runs": [r["wall_s"] for r in runs],
            # Where each run's time went (engine rows): whether a slow run was slow in
            # the fetch, in init around it, or in the kernel loads.
            "engine_s_runs": [r.get("engine_s") for r in runs],
            "phase_seconds_runs": [r.get("phase_seconds") for r in runs],
            "origin_requests_runs": [r["origin_requests"] for r in runs],
            "complete": all(r["complete"] for r in runs)}


def floor_s(k: int, concurrent: int, latency: float, total_bytes: int,
            bandwidth: float) -> float:
    """The physical floor: ceil(K / concurrent) request latencies plus the bytes at
    the origin's bandwidth."""
    return math.ceil(k / max(1, concurrent)) * latency + total_bytes / bandwidth


def with_floor(row: dict[str, Any], concurrent: int, args: argparse.Namespace,
               total_bytes: int) -> dict[str, Any]:
    """``row`` with the download floor at its concurrency and, for a row that downloads
    (not in :data:`WARM`), its ratio to that floor."""
    floor = floor_s(args.artifacts, concurrent, args.latency, total_bytes, args.bandwidth)
    return {**row, "concurrent_downloads": concurrent, "floor_s": floor,
            **({} if row.get("strategy") in WARM else {"vs_floor": row["wall_s"] / floor})}


def row_label(row: dict[str, Any]) -> str:
    return LABELS.get(row["strategy"],
                      f"one process, {row['concurrent_downloads']} threads (baseline)")


def print_row(row: dict[str, Any], *, header: bool = False) -> None:
    if header:
        print(f"{'strategy':<36} {'N':>2} {'conc':>4} {'requests':>8} {'origin MB':>9} "
              f"{'wall s':>7} {'floor s':>7} {'x floor':>7} {'RSS MB':>7} {'start-up s':>10}")
    label = row_label(row)
    flag = "" if row["complete"] else "  INCOMPLETE"
    print(f"{label:<36} {row['ranks']:>2} {row['concurrent_downloads']:>4} "
          f"{row['origin_requests']:>8} {row['origin_bytes'] / 1e6:>9.1f} "
          f"{row['wall_s']:>7.3f} {row['floor_s']:>7.3f} "
          f"{format(row['vs_floor'], '.2f') if 'vs_floor' in row else '-':>7} "
          f"{row['peak_rss_bytes'] / 1e6:>7.1f} {row['startup_s']:>10.2f}{flag}", flush=True)


def check_targets(rows: list[dict[str, Any]], baselines: dict[int, dict[str, Any]],
                  args: argparse.Namespace, total_bytes: int) -> list[dict[str, Any]]:
    k = args.artifacts

    def of(strategy: str) -> dict[int, dict[str, Any]]:
        return {r["ranks"]: r for r in rows if r["strategy"] == strategy}

    def listed(rows_by_n: dict[int, dict[str, Any]], key: str) -> str:
        return ", ".join(f"N={n}: {r[key]}" for n, r in rows_by_n.items())

    def requests(row: dict[str, Any]) -> set[int]:
        """The origin requests of every run of ``row``'s cell, not only the median's."""
        return set(row.get("origin_requests_runs", [row["origin_requests"]]))

    def done(*used: dict[str, Any]) -> bool:
        """Whether every run of every row a target reads served every artifact right:
        a target read from an incomplete row does not hold, whatever its figures."""
        return all(r["complete"] for r in used)

    def bare_beside(row: dict[str, Any]) -> str:
        """The baseline at ``row``'s concurrency against the same latency floor: one
        process downloading the set with nothing else on its clock (no imports, no
        init, no kernel loads), what no start-up at that concurrency can beat."""
        bare = baselines.get(row["concurrent_downloads"])
        if bare is None:
            return ""
        return (f"; one process downloading the set at the same {bare['concurrent_downloads']}"
                f" connections: {bare['wall_s']:.3f} s "
                f"({bare['wall_s'] / row['latency_floor_s']:.2f}x)")

    per_rank, pre, warm = of("per-rank"), of("prefetch"), of("warm")
    engine, engine_warm, fi_node = of("engine"), of("engine-warm"), of("fi-per-node")
    engine_init, engine_init_warm = of("engine-init"), of("engine-init-warm")
    targets = []
    if pre:
        top = max(pre)
        fair = baselines[top * args.downloads_per_rank]
        ratio = pre[top]["wall_s"] / fair["wall_s"]
        targets += [
            {
                "target": f"(d) makes exactly K={k} origin requests at every N",
                "holds": all(requests(r) == {k} for r in pre.values()) and done(*pre.values()),
                "observed": listed(pre, "origin_requests"),
            },
            {
                "target": f"(d) wall time at N={top} within 1.3x of one process at the same "
                          f"total concurrency ({top * args.downloads_per_rank} threads)",
                "holds": ratio <= 1.3 and done(pre[top], fair),
                "observed": f"{pre[top]['wall_s']:.3f} s vs {fair['wall_s']:.3f} s "
                            f"({ratio:.2f}x)",
            },
        ]
    if warm:
        targets.append({
            "target": "(e) makes 0 origin requests",
            "holds": all(requests(r) == {0} for r in warm.values()) and done(*warm.values()),
            "observed": listed(warm, "origin_requests"),
        })
    if per_rank:
        targets.append({
            "target": "(a) makes N*K origin requests",
            "holds": (all(requests(r) == {n * k} for n, r in per_rank.items())
                      and done(*per_rank.values())),
            "observed": listed(per_rank, "origin_requests"),
        })
    if 4 in engine:
        row = engine[4]
        floor16 = floor_s(k, 16, args.latency, total_bytes, args.bandwidth)
        targets += [
            {"target": f"(h) 2x2 cold prefetch + kernel loads make exactly K={k} origin "
                       "requests",
             "holds": requests(row) == {k} and done(row),
             "observed": str(row["origin_requests"])},
            {"target": "(h) 2x2 cold prefetch + kernel loads ready within 1.5x the "
                       f"latency floor for 16 concurrent downloads ({floor16:.3f} s)",
             "holds": row["wall_s"] <= 1.5 * floor16 and done(row),
             "observed": f"{row['wall_s']:.3f} s ({row['wall_s'] / floor16:.2f}x)"},
        ]
        if 4 in fi_node:
            ratio = row["wall_s"] / fi_node[4]["wall_s"]
            quarter = 0.25 * fi_node[4]["wall_s"]
            # Whether any program could: at equal concurrency the K requests alone take
            # the floor, so 0.25x (g) is reachable only where (g) takes 4x that floor.
            reach = (f"; 0.25x (g) is {quarter:.3f} s, below the floor for 16 concurrent "
                     f"downloads ({floor16:.3f} s): out of reach for any program"
                     if quarter < floor16 else "")
            targets.append({
                "target": "(h) 2x2 cold prefetch + kernel loads <= 0.25x FlashInfer alone "
                          "with one directory per node (g)",
                "holds": ratio <= 0.25 and done(row, fi_node[4]),
                "observed": f"{row['wall_s']:.3f} s vs {fi_node[4]['wall_s']:.3f} s "
                            f"({ratio:.2f}x){reach}"})
    if engine_warm:
        targets.append({
            "target": "(i) warm prefetch + kernel loads make 0 origin requests",
            "holds": (all(requests(r) == {0} for r in engine_warm.values())
                      and done(*engine_warm.values())),
            "observed": listed(engine_warm, "origin_requests"),
        })
    if 4 in engine_init:
        row = engine_init[4]
        targets += [
            {"target": f"(j) 2x2 cold engine start-up through init makes exactly K={k} "
                       "origin requests",
             "holds": requests(row) == {k} and done(row),
             "observed": str(row["origin_requests"])},
            {"target": "(j) 2x2 cold engine start-up through init ready within 1.5x the "
                       "latency floor measured in the same run (ceil(K / 16) x "
                       f"{row['latency_floor_s'] / math.ceil(k / 16):.3f} s = "
                       f"{row['latency_floor_s']:.3f} s)",
             "holds": row["vs_latency_floor"] <= 1.5 and done(row),
             "observed": f"{row['wall_s']:.3f} s ({row['vs_latency_floor']:.2f}x)"
                         + bare_beside(row)},
        ]
    if engine_init_warm:
        targets.append({
            "target": "(k) warm engine start-up through init makes 0 origin requests",
            "holds": (all(requests(r) == {0} for r in engine_init_warm.values())
                      and done(*engine_init_warm.values())),
            "observed": listed(engine_init_warm, "origin_requests"),
        })
    if 4 in engine_init_warm:
        row = engine_init_warm[4]
        targets.append({
            "target": f"(k) 2x2 warm engine start-up through init ready within "
                      f"{ENGINE_WARM_TARGET_S} s",
            "holds": row["wall_s"] <= ENGINE_WARM_TARGET_S and done(row),
            "observed": f"{row['wall_s']:.3f} s",
        })
    return targets


def write_results(
    args: argparse.Namespace,
    total_bytes: int,
    measured: dict[str, float],
    baselines: dict[int, dict[str, Any]],
    rows: list[dict[str, Any]],
    targets: list[dict[str, Any]],
    load_before: float,
) -> None:
    baseline = baselines[FLASHINFER_THREADS]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {
            "backend": "mpi",
            "ranks": sorted({r["ranks"] for r in rows}),
            "nodes": 1,
            "two_node_strategies": list(TWO_NODES),
            "artifacts": args.artifacts,
            "artifact_bytes": total_bytes,
            "min_size": args.min_size,
            "max_size": args.max_size,
            "injected_latency_s": args.latency,
            "bandwidth_cap_Bps": args.bandwidth,
            "downloads_per_rank": args.downloads_per_rank,
            "repeat": args.repeat,
            "bcast_ranks": 2,
            "cpus": os.cpu_count(),
            # Other work on the machine shows in the wall times; this says how much.
            "load_average_before_after": [load_before, os.getloadavg()[0]],
        },
        "measured": measured,
        "baseline": baseline,
        "baselines": [baselines[t] for t in sorted(baselines)],
        "floor": "ceil(K / concurrent downloads) x latency + bytes / bandwidth",
        "results": rows,
        "targets": targets,
    }
    json_path = args.out / f"{args.name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(args, rows, baseline, json_path.with_suffix(".png"))
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")


def plot(args: argparse.Namespace, rows: list[dict[str, Any]], baseline: dict[str, Any],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    styles = ("o-", "s-", "D-", "^-", "v-", "<-", ">-", "P-", "X-", "*-", "h-")
    for strategy, style in zip(STRATEGIES, styles, strict=True):
        mine = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["ranks"])
        if not mine:
            continue
        xs = [r["ranks"] for r in mine]
        left.plot(xs, [r["wall_s"] for r in mine], style, label=LABELS[strategy])
        right.plot(xs, [r["origin_requests"] for r in mine], style, label=LABELS[strategy])
    left.axhline(baseline["wall_s"], color="grey", linestyle=":",
                 label=f"one process, {FLASHINFER_THREADS} threads")
    left.set_yscale("log")
    left.set_ylabel("wall seconds until every rank is ready")
    right.set_ylabel("origin requests")
    right.set_yscale("symlog", linthresh=1)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (MPI processes, one node)")
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(
        f"{args.artifacts} artifacts, {args.latency * 1e3:g} ms/request, "
        f"{args.bandwidth / 1e6:g} MB/s origin cap, {args.downloads_per_rank} downloads/rank",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_prefetch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", default="1,2,4,8", help="comma-separated N")
    parser.add_argument("--artifacts", type=int, default=64)
    parser.add_argument("--min-size", type=int, default=50_000)
    parser.add_argument("--max-size", type=int, default=600_000)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds per origin request")
    parser.add_argument("--bandwidth", type=float, default=200e6, help="origin bytes/s, total")
    parser.add_argument("--downloads-per-rank", type=int,
                        help="download threads per rank (default: "
                             "DISTCACHE_DOWNLOADS_PER_RANK's)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help="comma-separated subset (warm needs prefetch before it, "
                             "engine-init-warm needs engine-init)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per cell; the one with the median wall time is reported")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--name", default="bench_prefetch",
                        help="writes OUT/NAME.json and OUT/NAME.png (a subset of the "
                             "strategies under its own name: --strategies engine-init,"
                             "engine-init-warm --ranks 4 --name engine_startup)")
    # Set by the driver when it launches itself under mpirun.
    parser.add_argument("--worker", choices=(*STRATEGIES, BASELINE, BCAST), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mirror", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.worker in ENGINE_INIT:
        engine_init_worker(args)  # before anything imports distcache
    elif args.worker:
        worker(args)
    else:
        if args.downloads_per_rank is None:
            from distcache.config import settings

            args.downloads_per_rank = settings().downloads_per_rank
        driver(args)


if __name__ == "__main__":
    main()
