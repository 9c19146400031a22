"""One rank of a multi-process prefetch: runs :func:`distcache.prefetch` and writes what
it saw as ``OUT/rank<N>.json``.

    prefetch_worker.py --comm mpi|torch --pools DIR --layout node|shared
                       --origin URL --manifest FILE --out DIR

The checkout must be importable: the drivers put it on ``PYTHONPATH``
(:func:`tests.support.helpers.mpi_env` does), or run it as
``python -m tests.multinode.prefetch_worker`` from the repository root.

``--layout node`` gives each ``DISTCACHE_NODE_ID`` its own pool (``DIR/<node id>``),
``--layout shared`` one pool for every rank (``DIR/shared``). A ``PrefetchError`` is
caught and recorded (type, message, artifact), so the driver can check that every rank
raised the same one.

Each rank also counts the artifact bytes it sent and received through the
communicator (every ``broadcast_bytes``, including those on split-off
communicators), which the report only gives summed over ranks. After a final
barrier rank 0 records the origin's ``/_stats``, so a driver that cannot reach the
origin (another network namespace) still learns the request count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import distcache
from distcache import ArtifactPool, HttpOrigin, parse_checksums
from distcache.comm import Communicator
from distcache.errors import PrefetchError

TIMEOUT_S = 60.0


@dataclasses.dataclass
class Tally:
    """Artifact-stream bytes one rank moved through its communicators."""

    sent: int = 0
    received: int = 0


class CountingComm:
    """A communicator that counts the bytes each ``broadcast_bytes`` moved for this rank
    (as root: sent; otherwise: received), and hands the same tally to its splits."""

    def __init__(self, inner: Communicator, tally: Tally) -> None:
        self._inner = inner
        self.tally = tally

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def size(self) -> int:
        return self._inner.size

    @property
    def node_id(self) -> str:
        return self._inner.node_id

    @property
    def backend(self) -> str:
        return self._inner.backend

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        out = self._inner.broadcast_bytes(data, root, timeout=timeout)
        if self._inner.rank == root:
            self.tally.sent += len(out)
        else:
            self.tally.received += len(out)
        return out

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return self._inner.allgather_object(obj, timeout=timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        self._inner.barrier(timeout=timeout)

    def split(self, color: int) -> CountingComm:
        return CountingComm(self._inner.split(color), self.tally)


def _world(kind: str) -> Communicator:
    if kind == "mpi":
        return distcache.comm.from_mpi(timeout=TIMEOUT_S)
    import launch

    launch.init_process_group(backend="gloo", timeout=TIMEOUT_S)
    # distcache's own gloo group on the default group's store, as init makes it.
    return distcache.comm.from_torch(timeout=TIMEOUT_S)


def _error(exc: PrefetchError) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        # The error tree sets its keyword arguments as attributes.
        "artifact": getattr(exc, "artifact", None),
        "rank": getattr(exc, "rank", None),
        "host": getattr(exc, "host", None),
        "phase": getattr(exc, "phase", None),
    }


def _attempt(
    comm: CountingComm, pool: ArtifactPool, origin: HttpOrigin, manifest: Path
) -> dict[str, Any]:
    artifacts = parse_checksums(manifest.read_text())
    before = (comm.tally.sent, comm.tally.received)
    try:
        report = distcache.prefetch(artifacts, comm=comm, pool=pool, origin=origin)
    except PrefetchError as exc:
        outcome: dict[str, Any] = {"report": None, "error": _error(exc)}
    else:
        outcome = {"report": report.as_dict(), "error": None}
    outcome["sent_bytes"] = comm.tally.sent - before[0]
    outcome["received_bytes"] = comm.tally.received - before[1]
    return outcome


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/_stats", timeout=10) as answer:
        return dict(json.load(answer))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--comm", choices=("mpi", "torch"), required=True)
    parser.add_argument("--pools", type=Path, required=True)
    parser.add_argument("--layout", choices=("node", "shared"), required=True)
    parser.add_argument("--origin", required=True)
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    comm = CountingComm(_world(args.comm), Tally())
    pool_dir = args.pools / (comm.node_id if args.layout == "node" else "shared")
    pool = ArtifactPool(pool_dir)
    origin = HttpOrigin(args.origin, retries=0)

    record: dict[str, Any] = {
        "rank": comm.rank,
        "size": comm.size,
        "node_id": comm.node_id,
        "backend": comm.backend,
        "pool": str(pool_dir),
        "pid": os.getpid(),
    }
    record["prefetch"] = _attempt(comm, pool, origin, args.manifest)
    comm.barrier(timeout=TIMEOUT_S)
    if comm.rank == 0:
        record["origin_stats"] = _stats(args.origin)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / f".rank{comm.rank}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(args.out / f"rank{comm.rank}.json")
    # Nobody leaves before every rank has written its record.
    comm.barrier(timeout=TIMEOUT_S)
    if args.comm == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
