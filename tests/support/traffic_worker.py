"""One rank of the per-rank traffic test: counts, with a counting communicator, the
bytes this rank sends and receives in a warm prefetch (agreement, planning) and in
``sync`` (with and without a state), and writes them as ``OUT/rank<N>.json``.

    traffic_worker.py --per-node R --pools DIR --set DIR --out DIR [--flat]

Rank r runs on simulated node ``r // R`` and uses that node's pool (``DIR/node<k>``);
the node's lowest rank seeds it with every artifact of ``--set`` first, so the
prefetch finds every object in every pool and never asks its origin. ``--flat`` gives
every rank a node id of its own (the pools stay per node), which is how a job
whose collectives do not aggregate per node behaves: the baseline the test compares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, BinaryIO

from mpi4py import MPI

import distcache
from distcache import Artifact, ArtifactPool
from distcache.collective import SyncState
from distcache.comm import CountingCommunicator, from_mpi

TIMEOUT_S = 120.0


class RefusingOrigin:
    """An origin a warm prefetch must never ask."""

    def describe(self) -> str:
        return "refusing origin"

    def fetch(self, artifact: Artifact) -> bytes:
        raise AssertionError(f"the origin was asked for {artifact.name}")

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        return len(self.fetch(artifact))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-node", type=int, required=True)
    parser.add_argument("--pools", type=Path, required=True)
    parser.add_argument("--set", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--flat", action="store_true")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    node = rank // args.per_node
    node_id = f"rank{rank}" if args.flat else f"node{node}"
    comm = CountingCommunicator(from_mpi(node_id=node_id, timeout=TIMEOUT_S))
    pool = ArtifactPool(args.pools / f"node{node}")
    listing = distcache.parse_checksums((args.set / "checksums.txt").read_text())
    if rank % args.per_node == 0:
        for artifact in listing:
            pool.put((args.set / artifact.name).read_bytes(), artifact.sha256)
        pool.remember(listing)
    comm.barrier()

    figures: dict[str, Any] = {"rank": rank, "node": node}

    def counted(name: str, step: Any) -> None:
        before = comm.traffic.snapshot()
        step()
        after = comm.traffic.snapshot()
        figures[name] = {"sent": after[0] - before[0], "received": after[1] - before[1]}

    def warm() -> None:
        report = distcache.prefetch(listing, comm=comm, pool=pool, origin=RefusingOrigin(),
                                    timeout=TIMEOUT_S)
        assert report.downloads == 0 and report.pool_hits == len(listing), report

    counted("first_prefetch", warm)
    counted("prefetch", warm)
    counted("sync_without_state", lambda: distcache.sync(comm=comm, pool=pool,
                                                         timeout=TIMEOUT_S))
    state = SyncState()
    counted("second_sync_without_state", lambda: distcache.sync(comm=comm, pool=pool,
                                                                timeout=TIMEOUT_S))
    counted("first_sync", lambda: distcache.sync(comm=comm, pool=pool, timeout=TIMEOUT_S,
                                                 state=state))
    counted("sync", lambda: distcache.sync(comm=comm, pool=pool, timeout=TIMEOUT_S,
                                           state=state))
    figures["calls"] = comm.traffic.calls
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(figures))
    comm.barrier()


if __name__ == "__main__":
    main()
