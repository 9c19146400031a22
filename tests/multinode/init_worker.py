"""One rank of a start-up through the public hook: ``distcache.init`` with a manifest,
then what it saw as ``OUT/rank<N>.json``.

    init_worker.py --pool DIR --manifest FILE --origin URL --out DIR [--timeout S]
                   [--torch] [--thread-level LEVEL] [--wedge SECONDS] [--ipc]

``--torch`` hands ``init`` a gloo communicator (``distcache.comm.from_torch``) in
place of the MPI one it adopts by itself; ``--thread-level`` initialises MPI at that
level (``mpi4py.rc.thread_level``, as an engine that initialises MPI itself may);
``--wedge`` holds the prefetch of a rank that runs it (a node leader, where members
leave it to theirs) that many seconds before it starts, with no collective in flight.
Records the pool id this rank knows its pool by after ``init``, too. An empty
``--origin`` gives this rank none; ``--ipc`` has ``init`` exchange IPC pools (none of
this rank's own: the exchange is a collective of its own between the peers' start and
the prefetch).

Records the report (or the error's type and message) and whether this rank loaded
the collective's planning (``distcache.collective._prefetch``): a node member whose
leader prefetched for it never does. Then reads every artifact of the manifest as
FlashInfer's loader does (``get(trust_own=True)``) and records how many reads hashed
their object and whether every read returned the right bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import distcache


def reads(pool: Any, manifest: Path) -> dict[str, Any]:
    """How many of the manifest's objects ``pool.get(trust_own=True)`` hashed, and
    whether each read returned bytes with the object's digest."""
    import hashlib

    from distcache.store import _objects

    hashed = []
    real = _objects.sha256_hex

    def counting(data: Any) -> str:
        hashed.append(1)
        return real(data)

    _objects.sha256_hex = counting  # type: ignore[assignment]
    try:
        shas = [line.split()[0] for line in manifest.read_text().splitlines() if line.strip()]
        got = [pool.get(sha, trust_own=True) for sha in shas]
    finally:
        _objects.sha256_hex = real  # type: ignore[assignment]
    return {"hashed_reads": len(hashed), "verified": len(pool.verified()),
            "reads_right": all(data is not None and hashlib.sha256(data).hexdigest() == sha
                               for sha, data in zip(shas, got, strict=True))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", type=Path, required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--origin", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--thread-level")
    parser.add_argument("--wedge", type=float)
    parser.add_argument("--ipc", action="store_true")
    args = parser.parse_args()
    if args.wedge:
        import time

        from distcache import _resolve

        prefetch = _resolve._prefetch

        def wedged(*given: Any, **named: Any) -> Any:
            time.sleep(args.wedge)
            return prefetch(*given, **named)

        _resolve._prefetch = wedged  # type: ignore[assignment]
    if args.thread_level:
        import mpi4py

        mpi4py.rc.thread_level = args.thread_level
    given = None
    if args.torch:
        import launch

        launch.init_process_group(backend="gloo", timeout=args.timeout)
        given = distcache.comm.from_torch(timeout=args.timeout)
    record: dict[str, Any] = {"error": None, "report": None}
    try:
        session = distcache.init(manifests=[str(args.manifest)], integrations=[],
                                 pool=args.pool, origin=args.origin or None,
                                 timeout=args.timeout, comm=given,
                                 ipc_pools=[] if args.ipc else None)
    except distcache.errors.DistcacheError as exc:
        record["error"] = [type(exc).__name__, str(exc)]
        comm = None
    else:
        comm = session.comm
        record["pool_id"] = session.pool.pool_id if session.pool is not None else None
        if session.report is not None:
            record["report"] = session.report.as_dict()
        if session.pool is not None:
            record.update(reads(session.pool, args.manifest))
    record["rank"] = int(os.environ["OMPI_COMM_WORLD_RANK"])
    record["planned"] = "distcache.collective._prefetch" in sys.modules
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{record['rank']}.json").write_text(json.dumps(record))
    if comm is not None:
        comm.barrier(timeout=args.timeout)
    if args.torch:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
