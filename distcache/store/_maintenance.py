"""Pool maintenance: LRU collection, full verification, statistics and the sweep of
files left by crashed writers.

These are whole-pool scans that run rarely (at open, past the size cap, or when an
operator asks), unlike the per-object reads and writes of :mod:`distcache.store._pool`, so
they live apart from the store. Each function takes the pool it works on;
:class:`~distcache.store._pool.ArtifactPool` exposes them as its ``gc``, ``verify``,
``stats`` and ``sweep`` methods, which is how callers reach them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from distcache.store._fs import is_sha
from distcache.store._locking import FileLock
from distcache.store._report import GcReport, PoolStats, VerifyReport

if TYPE_CHECKING:
    from distcache.store._pool import ArtifactPool

__all__ = ["STALE_TMP_SECONDS", "gc", "stats", "sweep", "trim_quarantine", "verify"]

logger = logging.getLogger(__name__)

#: Temporary and lock files untouched this long (seconds) are taken as abandoned.
STALE_TMP_SECONDS = 3600.0


def gc(pool: ArtifactPool, max_bytes: int | None = None) -> GcReport:
    """Remove ``pool``'s least recently used objects until at most ``max_bytes``
    remain (default: the pool's cap; no cap means nothing is removed). Safe under
    concurrent readers: an open object stays readable; a reader that comes later
    sees a miss.

    Raises:
        PoolError: the objects directory cannot be listed.
    """
    cap = pool.max_bytes if max_bytes is None else max_bytes
    entries = sorted(((st.st_mtime_ns, path, st.st_size) for path, _sha, st in pool._scan()))
    total = sum(size for _m, _p, size in entries)
    removed = freed = 0
    if cap is not None:
        for _mtime, path, size in entries:
            if total - freed <= cap:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("cannot remove %s during gc: %s", path, exc)
                continue
            removed += 1
            freed += size
    pool._set_approx_bytes(total - freed)
    if removed:
        logger.info("gc removed %d objects (%d bytes) from %s", removed, freed, pool.root)
    return GcReport(max_bytes=cap, removed=removed, freed_bytes=freed,
                    kept=len(entries) - removed, kept_bytes=total - freed)


def verify(pool: ArtifactPool) -> VerifyReport:
    """Hash every object of ``pool``; quarantine the corrupt ones.

    Raises:
        PoolError: the pool cannot be listed or an object cannot be read.
    """
    ok = corrupt = ok_bytes = 0
    for _path, sha, _st in list(pool._scan()):
        data = pool._read(sha, stamp=False)
        if data is None:
            corrupt += 1
        else:
            ok += 1
            ok_bytes += len(data)
    return VerifyReport(ok=ok, corrupt=corrupt, quarantined=_count(pool._quarantine),
                        ok_bytes=ok_bytes)


def stats(pool: ArtifactPool) -> PoolStats:
    """Counts from a directory scan of ``pool`` (no hashing).

    Raises:
        PoolError: the pool cannot be listed.
    """
    count = size = 0
    for _path, _sha, st in pool._scan():
        count += 1
        size += st.st_size
    return PoolStats(root=pool.root, pool_id=pool.pool_id, objects=count, bytes=size,
                     quarantined=_count(pool._quarantine),
                     tmp_files=_count(pool._tmp), names=len(pool.names()),
                     max_bytes=pool.max_bytes)


def _count(directory: Path) -> int:
    try:
        with os.scandir(directory) as it:
            return sum(1 for _ in it)
    except OSError:
        return 0


def sweep(pool: ArtifactPool, max_age: float = STALE_TMP_SECONDS) -> int:
    """Remove ``pool``'s temporary files untouched for ``max_age`` seconds (left by
    crashed writers; a live download keeps its file's mtime fresh) and lock files
    nobody holds. Returns the number of files removed.
    """
    removed = 0
    cutoff = time.time() - max_age
    for path in _older_than(pool._tmp, cutoff):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    for path in _older_than(pool._locks, cutoff):
        lock = FileLock(path, timeout=0, remove_on_release=True)
        if lock.acquire() and lock.held:
            lock.release()
            removed += 1
    if removed:
        logger.info("swept %d stale temporary/lock files from %s", removed, pool.root)
    return removed


def _older_than(directory: Path, cutoff: float) -> list[str]:
    # Every process that opens a shared pool sweeps it: an entry another sweeper
    # removed between the listing and its stat is skipped, not the whole directory.
    found = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                try:
                    if entry.stat(follow_symlinks=False).st_mtime <= cutoff:
                        found.append(entry.path)
                except OSError:
                    continue
    except OSError:
        return []
    return found


def trim_quarantine(pool: ArtifactPool) -> int:
    """Delete all but ``pool.quarantine_keep`` newest files of ``quarantine/`` (it is
    outside the size cap, so a medium that keeps corrupting objects would otherwise
    fill the disk with them). Returns the number deleted.
    """
    # Names are "<sha>.<time_ns>.<pid>.<hex>": order by the time of quarantine
    # (rename keeps the object's old mtime). Other names are left alone.
    entries: list[tuple[int, str]] = []
    try:
        with os.scandir(pool._quarantine) as it:
            for entry in it:
                parts = entry.name.split(".")
                if len(parts) == 4 and is_sha(parts[0]) and parts[1].isdigit():
                    entries.append((int(parts[1]), entry.path))
    except OSError:
        return 0
    entries.sort(reverse=True)
    removed = 0
    for _when, path in entries[pool.quarantine_keep :]:
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
