"""Pool maintenance: LRU collection, full verification, statistics and the sweep of
files left by crashed writers.

These are whole-pool scans that run rarely (at open, past the size cap, or when an
operator asks), unlike the per-object reads and writes of
:mod:`distcache.store._objects`, so they live apart from them. They work on a
:class:`~distcache.store.layout.PoolLayout` (and, to verify, the
:class:`~distcache.store._objects.ObjectStore` that reads and quarantines), never on
a pool object: :class:`~distcache.store._pool.ArtifactPool` calls them as its ``gc``,
``verify``, ``stats`` and ``sweep`` methods, which is how callers reach them.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.store._locking import FileLock
from distcache.store._objects import ObjectStore, scan_objects
from distcache.store.layout import STALE_TMP_SECONDS, PoolLayout

if TYPE_CHECKING:
    from distcache.store._report import GcReport, PoolStats, VerifyReport

logger = get_logger(__name__)


def gc(layout: PoolLayout, max_bytes: int | None) -> GcReport:
    """Remove the least recently used objects of the pool at ``layout`` until at
    most ``max_bytes`` remain (``None``: no cap, nothing is removed). Safe under
    concurrent readers: an open object stays readable; a reader that comes later
    sees a miss.

    Raises:
        PoolError: the objects directory cannot be listed.
    """
    from distcache.store._report import GcReport  # the report, with the call

    entries = sorted((st.st_mtime_ns, path, st.st_size) for path, _sha, st in scan_objects(layout))
    total = sum(size for _m, _p, size in entries)
    removed = freed = 0
    if max_bytes is not None:
        for _mtime, path, size in entries:
            if total - freed <= max_bytes:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("cannot remove %s during gc: %s", path, exc)
                if exc.errno == errno.EROFS:
                    break  # the whole pool is read-only: no other object can go either
                continue
            removed += 1
            freed += size
    if removed:
        logger.info("gc removed %d objects (%d bytes) from %s", removed, freed, layout.root)
    return GcReport(max_bytes=max_bytes, removed=removed, freed_bytes=freed,
                    kept=len(entries) - removed, kept_bytes=total - freed)


def verify(store: ObjectStore) -> VerifyReport:
    """Hash every object of ``store``; quarantine the corrupt ones.

    Raises:
        PoolError: the pool cannot be listed or an object cannot be read.
    """
    from distcache.store._report import VerifyReport  # the report, with the call

    ok = corrupt = ok_bytes = 0
    for _path, sha, _st in list(store.scan()):
        data = store.read(sha, stamp=False)
        if data is None:
            corrupt += 1
        else:
            ok += 1
            ok_bytes += len(data)
    return VerifyReport(ok=ok, corrupt=corrupt, quarantined=_count(store.layout.quarantine),
                        ok_bytes=ok_bytes)


def stats(layout: PoolLayout, *, pool_id: str, names: int, max_bytes: int | None) -> PoolStats:
    """Counts from a directory scan of the pool at ``layout`` (no hashing); the
    pool's ``pool_id``, number of ``names`` and ``max_bytes`` are reported as given.

    Raises:
        PoolError: the pool cannot be listed.
    """
    from distcache.store._report import PoolStats  # the report, with the call

    count = size = 0
    for _path, _sha, st in scan_objects(layout):
        count += 1
        size += st.st_size
    return PoolStats(root=layout.root, pool_id=pool_id, objects=count, bytes=size,
                     quarantined=_count(layout.quarantine), tmp_files=_count(layout.tmp),
                     names=names, max_bytes=max_bytes)


def _count(directory: Path) -> int:
    try:
        with os.scandir(directory) as it:
            return sum(1 for _ in it)
    except OSError:
        return 0


def sweep(layout: PoolLayout, max_age: float = STALE_TMP_SECONDS) -> int:
    """Remove the temporary files of the pool at ``layout`` untouched for ``max_age``
    seconds (left by crashed writers; a live download keeps its file's mtime fresh)
    and lock files nobody holds. Returns the number of files removed.
    """
    removed = 0
    cutoff = time.time() - max_age
    for path in _older_than(layout.tmp, cutoff):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    for path in _older_than(layout.locks, cutoff):
        lock = FileLock(path, timeout=0, remove_on_release=True)
        if lock.acquire() and lock.held:
            lock.release()
            removed += 1
    if removed:
        logger.info("swept %d stale temporary/lock files from %s", removed, layout.root)
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
