"""A rank of an engine that calls distcache.init with no communicator of its own.

Usage: init_prog.py POOL_DIR ORIGIN_URL MANIFEST. Prints one ``INIT`` line per rank.
"""

from __future__ import annotations

import sys

import distcache


def main() -> int:
    pool, url, manifest = sys.argv[1:4]
    session = distcache.init(pool=pool, origin=url, manifests=[manifest], flashinfer=False)
    report = session.report
    assert report is not None
    assert distcache.init() is session
    print(
        f"INIT {session.comm.rank} {session.comm.size} {session.comm.backend} "
        f"{report.downloads} {sum(1 for _ in session.pool.objects())}",  # type: ignore[union-attr]
        flush=True,
    )
    session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
