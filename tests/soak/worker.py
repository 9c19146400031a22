"""One rank of a soak job: run the rounds the driver posts, report each outcome.

Started by :mod:`tests.support.soak` under ``mpirun -n 4``, as
``python -m tests.soak.worker CONTROL`` with the checkout on ``PYTHONPATH``; the only
argument is the job's control directory. The driver posts ``round-<k>.json`` (the artifact list, or
``stop``) and reads back ``done-<k>-<rank>.json``. Each round opens its pool afresh (so
the sweep of stale files runs every round) and calls :func:`distcache.prefetch` over
the MPI world, or (a "lazy" round) reads each artifact through ``pool.fetch`` the way
the serving path does and then calls :func:`distcache.sync`. After a successful round every rank reads back each artifact through
``pool.get`` and hashes it independently, so corrupt bytes served would be counted
here, not just trusted.

A rank whose communicator broke (a peer was killed or hung past the timeout) reports
and leaves without ``MPI_Finalize``: the library's promise ends at raising within its
timeout, and finalising with a dead peer is up to the MPI library.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from distcache import Artifact, ArtifactPool, HttpOrigin, prefetch, sync
from distcache.comm import from_mpi
from distcache.errors import DistcacheError, IntegrityError, OriginError, PoolError, PrefetchError

_POLL_S = 0.005


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    os.replace(tmp, path)


def _wait_for(path: Path, deadline: float) -> dict[str, Any] | None:
    while time.monotonic() < deadline:
        try:
            return dict(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            time.sleep(_POLL_S)
    return None


def _read_back(pool: ArtifactPool, artifacts: list[Artifact]) -> tuple[int, list[str]]:
    """(corrupt bytes served, shas missing) over ``artifacts``. A prefetch trusts an
    object's presence (no hashing at discovery), so an object corrupted in place is
    found here, quarantined and reported missing."""
    corrupt = 0
    missing: list[str] = []
    for artifact in artifacts:
        data = pool.get(artifact.sha256)
        if data is None:
            missing.append(artifact.sha256)
        elif hashlib.sha256(data).hexdigest() != artifact.sha256:
            corrupt += 1
    return corrupt, missing


def _fetch_lazily(pool: ArtifactPool, origin: HttpOrigin, artifacts: list[Artifact],
                  rank: int) -> int:
    """The serving path: each rank reads through the pool in its own order (ranks
    sharing a pool meet on the per-object download lock). Returns the failures."""
    errors = 0
    order = artifacts[rank % len(artifacts):] + artifacts[: rank % len(artifacts)]
    for artifact in order:
        try:
            pool.fetch(artifact, origin)
        except (OriginError, IntegrityError, PoolError):
            errors += 1
    return errors


def _settle_downloads(limit: float = 10.0) -> float:
    """Wait (at most ``limit`` s) for downloads a timed-out prefetch left running.

    They are harmless to a job (whatever they publish is whole), but a request one of
    them makes after the driver has reset the origin's counters would be charged to the
    next round. Returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < limit and any(
        t.name.startswith("distcache-fetch-") and t.is_alive() for t in threading.enumerate()
    ):
        time.sleep(_POLL_S)
    return time.monotonic() - start


def run_round(spec: dict[str, Any], comm: Any, origin: HttpOrigin, pool_root: str) -> dict[str, Any]:
    artifacts = [Artifact(n, s, z) for n, s, z in spec["artifacts"]]
    result: dict[str, Any] = {"rank": comm.rank, "ok": False, "comm_broken": False}
    start = time.monotonic()
    lazy = spec.get("mode") == "lazy"
    try:
        pool = ArtifactPool(pool_root)
        if lazy:
            result["lazy_errors"] = _fetch_lazily(pool, origin, artifacts, comm.rank)
            report = sync(comm=comm, pool=pool)
        else:
            report = prefetch(artifacts, comm=comm, pool=pool, origin=origin)
    except PrefetchError as exc:
        result.update(error="PrefetchError", phase=getattr(exc, "phase", None),
                      artifact=getattr(exc, "artifact", None), message=str(exc)[:400])
        result["comm_broken"] = getattr(exc, "phase", None) == "collective"
    except DistcacheError as exc:
        result.update(error=type(exc).__name__, message=str(exc)[:400], unexpected=True)
    except Exception as exc:
        result.update(error=type(exc).__name__, message=repr(exc)[:400], unexpected=True)
    else:
        corrupt, missing = _read_back(pool, artifacts)
        if lazy:
            missing = []  # a lazy fetch that failed everywhere leaves a gap sync cannot fill
        result.update(ok=True, downloads=report.downloads, origin_bytes=report.origin_bytes,
                      corrupt_served=corrupt, missing_after_ok=missing)
    result["seconds"] = time.monotonic() - start
    result["settle_seconds"] = _settle_downloads()
    return result


def main() -> int:
    control = Path(sys.argv[1])
    job = json.loads((control / "job.json").read_text(encoding="utf-8"))
    comm = from_mpi()
    rank = comm.rank
    _write_json(control / f"pid-{rank}.json", {"pid": os.getpid()})
    origin = HttpOrigin(job["origin"])
    pool_root = job["pool_of_rank"][rank]
    k = int(job["first_round"])
    while True:
        spec = _wait_for(control / f"round-{k}.json", time.monotonic() + float(job["idle_s"]))
        if spec is None or spec.get("stop"):
            if spec is not None and spec.get("peer_killed"):
                os._exit(0)  # MPI_Finalize with a dead peer is the MPI library's business
            break
        result = run_round(spec, comm, origin, pool_root)
        _write_json(control / f"done-{k}-{rank}.json", result)
        if result["comm_broken"]:
            sys.stdout.flush()
            os._exit(3)
        k += 1
    origin.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
