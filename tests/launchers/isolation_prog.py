"""An "engine" under a real launcher, for the communicator-isolation tests.

    python -m tests.launchers.isolation_prog SCENARIO POOL_DIR ORIGIN_URL MANIFEST OUT_DIR

Each rank writes ``OUT_DIR/rank-<r>.json`` with what it saw. Scenarios:

* ``init-then-engine`` (torchrun): ``distcache.init`` first, then the engine's own
  ``init_process_group("gloo")`` and ``all_reduce`` before and after ``close``;
* ``mpi-rank0-alone`` (mpirun): rank 0 alone calls ``init(timeout=3)``; then the
  engine's ``COMM_WORLD`` ``allreduce``;
* ``engine-then-rank0-alone`` (torchrun): the engine's group first; rank 0 alone calls
  ``init(timeout=3)``; then the engine's ``all_reduce``;
* ``background`` / ``foreground`` (mpirun or torchrun): the engine all-reduces in a
  loop on its own communicator while ``init(background=True)`` prefetches; the
  foreground run gives the report to compare with.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import distcache
from distcache.errors import DistcacheError


def _under_mpi() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ


def _engine() -> Any:
    """The engine's own element-wise all-reduce over every rank: MPI's world or torch's
    default group, never distcache's."""
    if _under_mpi():
        from mpi4py import MPI

        return lambda *values: [MPI.COMM_WORLD.allreduce(v) for v in values]
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")

    def reduce(*values: int) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor)
        return [int(v) for v in tensor.tolist()]

    return reduce


def _report(report: Any) -> dict[str, Any] | None:
    if report is None:
        return None
    fields = report.as_dict()
    fields.pop("seconds")
    return fields


def main() -> int:
    scenario, pool, origin, manifest, out = sys.argv[1:6]
    rank = int(os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    record: dict[str, Any] = {"rank": rank}
    kw: dict[str, Any] = {"pool": f"{pool}/rank{rank}", "origin": origin,
                          "manifests": [manifest], "integrations": ()}
    if scenario == "init-then-engine":
        import torch.distributed as dist

        session = distcache.init(**kw)
        record["initialised_after_init"] = dist.is_initialized()
        record["downloads"] = session.report.downloads if session.report else None
        reduce = _engine()
        record["before_close"] = reduce(1)[0]
        session.close()
        record["after_close"] = reduce(1)[0]
        dist.destroy_process_group()
    elif scenario in ("mpi-rank0-alone", "engine-then-rank0-alone"):
        reduce = _engine() if scenario.startswith("engine") else None
        if rank == 0:
            started = time.monotonic()
            try:
                distcache.init(**kw, timeout=3)
                record["error"] = None
            except DistcacheError as exc:
                record["error"] = type(exc).__name__
                record["error_bases"] = [c.__name__ for c in type(exc).__mro__]
                record["message"] = str(exc)
            record["seconds"] = time.monotonic() - started
        if reduce is None:
            reduce = _engine()
        record["after"] = reduce(1)[0]
        if not _under_mpi():
            import torch.distributed as dist

            dist.destroy_process_group()
    elif scenario in ("background", "foreground"):
        reduce = _engine()
        session = distcache.init(**kw, background=scenario == "background")
        size = int(os.environ.get("WORLD_SIZE") or os.environ["OMPI_COMM_WORLD_SIZE"])
        rounds, right = 0, True
        # The engine keeps working on its own communicator while distcache fetches;
        # every rank runs the same rounds: until no rank's start-up is still running.
        while True:
            ones, running = reduce(1, 0 if session.ready else 1)
            rounds += 1
            right = right and ones == size
            if running == 0:
                break
        record["engine_reductions"] = rounds
        record["engine_sums_right"] = right
        record["report"] = _report(session.wait(60))
        record["after"] = reduce(1)[0]
        session.close()
        if not _under_mpi():
            import torch.distributed as dist

            dist.destroy_process_group()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    Path(out, f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
