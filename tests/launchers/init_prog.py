"""A rank of an engine that calls distcache.init with no communicator of its own.

Usage: init_prog.py POOL_DIR ORIGIN_URL MANIFEST. ``{rank}`` in POOL_DIR becomes the
launcher's rank (``RANK``, else Open MPI's), for one pool per rank. Prints one line
per rank: ``INIT rank size backend downloads objects-in-pool broadcast-bytes``
(downloads and broadcast bytes from the prefetch report, for the whole job).
"""

from __future__ import annotations

import os
import sys

import distcache


def main() -> int:
    pool, url, manifest = sys.argv[1:4]
    rank = (os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
            or os.environ.get("SLURM_PROCID") or "0")
    pool = pool.replace("{rank}", rank)
    session = distcache.init(pool=pool, origin=url, manifests=[manifest], integrations=())
    report = session.report
    assert report is not None
    assert distcache.init() is session
    assert session.pool is not None
    objects = sum(1 for _ in session.pool.objects())
    print(
        f"INIT {session.comm.rank} {session.comm.size} {session.comm.backend} "
        f"{report.downloads} {objects} {report.broadcast_bytes}",
        flush=True,
    )
    session.close()
    # init ran on a gloo group of distcache's own: torch.distributed's default group
    # was never brought up, so the engine is free to make its own.
    if session.comm.backend == "gloo":
        import torch.distributed as dist

        assert not dist.is_initialized()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
