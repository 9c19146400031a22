"""One rank of the demo job: what an engine's start-up does with distcache.

Run by ``scripts/demo.py`` under ``mpirun``; every rank calls ``distcache.init``
(prefetch + IPC exchange), then sends a burst of features to every other rank through
the shared-memory pools, and rank 0 writes a JSON report of what happened.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import zlib
from pathlib import Path

import distcache
from distcache.ipc import FeatureRef, ShmPool


def _feature(rank: int, index: int):  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator().manual_seed(rank * 100_003 + index)
    rows = 16 + (index % 7) * 32
    return torch.randn(rows, 256, generator=gen, dtype=torch.float32)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--origin", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--ipc-bytes", type=int, default=32 << 20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("distcache").setLevel(logging.WARNING)

    t0 = time.perf_counter()
    producer = ShmPool(args.ipc_bytes)
    session = distcache.init(
        manifests=[args.manifest], origin=args.origin, ipc_pools=[producer], integrations=()
    )
    comm, registry = session.comm, session.registry
    assert registry is not None
    init_s = time.perf_counter() - t0

    # The burst: every rank produces features; its node's other ranks resolve them all.
    t1 = time.perf_counter()
    sent: list[tuple[int, bytes]] = []
    copies = 0
    for i in range(args.features):
        ref = producer.put(_feature(comm.rank, i))
        if ref is None:  # pool full: an engine would send a copy instead
            copies += 1
            continue
        sent.append((i, ref.pack()))
    # Shared memory is node-local: each rank consumes the features of its node's peers.
    everyone = comm.allgather_object((comm.node_id, sent))
    resolved = checked = 0
    for owner, (node, packed_refs) in enumerate(everyone):
        if owner == comm.rank or node != comm.node_id:
            continue
        for index, packed in packed_refs:
            ref = FeatureRef.unpack(packed)
            expect = _feature(owner, index)
            # The view is used and acknowledged in one place: a tensor that outlives
            # its ack (or the registry) would keep reading a slot the producer reuses.
            with registry.view(ref) as view:
                if zlib.crc32(view.numpy().tobytes()) == zlib.crc32(expect.numpy().tobytes()):
                    checked += 1
            del view
            resolved += 1
    comm.barrier()
    burst_s = time.perf_counter() - t1

    pool = session.pool
    assert pool is not None
    mine = {
        "rank": comm.rank,
        "node": comm.node_id,
        "pool_id": pool.pool_id,
        "pool_objects": sum(1 for _ in pool.objects()),
        "opens": {str(k): v for k, v in registry.opens.items()},
        "resolved": resolved,
        "checked": checked,
        "copies": copies,
        "init_s": init_s,
        "burst_s": burst_s,
    }
    ranks = comm.allgather_object(mine)
    if comm.rank == 0:
        report = session.report
        assert report is not None
        out = {
            "world_size": comm.size,
            "backend": comm.backend,
            "prefetch": report.as_dict(),
            "phases": session.phases,
            "ranks": ranks,
        }
        Path(args.report).write_text(json.dumps(out, indent=2))
    session.close()
    producer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
