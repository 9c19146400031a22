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

import contextlib
import errno
import os
import stat
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.errors import PoolError
from distcache.store._fs import hash_fd, is_sha, pool_error
from distcache.store._locking import FileLock
from distcache.store._objects import ObjectStore, scan_objects
from distcache.store._reading import DIR_FLAGS, NotAnObject, open_object
from distcache.store.layout import STALE_TMP_SECONDS, PoolLayout

if TYPE_CHECKING:
    from distcache.store._report import GcReport, PoolStats, VerifyReport

logger = get_logger(__name__)


def gc(layout: PoolLayout, max_bytes: int | None, keep: Collection[str] = ()) -> GcReport:
    """Remove the least recently used objects of the pool at ``layout`` until at
    most ``max_bytes`` remain (``None``: no cap, nothing is removed), never one of
    ``keep`` (sha256s). Safe under concurrent readers: an open object stays
    readable; a reader that comes later sees a miss.

    The order comes from one scan, which may take long on a large pool; so each object
    is looked at again just before it goes, through its fan-out directory opened
    without following a link, and kept when it is no longer the file the scan found
    (read since, so its recency stamp moved; or replaced by another publication).
    Objects that cannot be removed (another user's pool) are logged a few at a time,
    then once in sum, not once each.

    Raises:
        PoolError: the objects directory cannot be listed.
    """
    from distcache.store._report import GcReport  # the report, with the call

    unlisted: list[tuple[str, OSError]] = []
    entries = sorted((st.st_mtime_ns, path, st.st_size, _seen(st))
                     for path, _sha, st in scan_objects(layout, unlisted))
    _warn_unlisted(unlisted, "neither counted nor collected")
    total = sum(entry[2] for entry in entries)
    removed = freed = 0
    # Objects another process removed since the scan: neither removed here nor kept.
    gone = gone_bytes = 0
    failures = _Failures(layout.root)
    if max_bytes is not None:
        for _mtime, path, size, seen in entries:
            if total - freed - gone_bytes <= max_bytes:
                break
            if keep and os.path.basename(path) in keep:
                continue
            try:
                outcome = _remove_unchanged(layout, os.path.basename(path), seen)
            except OSError as exc:
                failures.add(path, exc)
                if exc.errno == errno.EROFS:
                    break  # the whole pool is read-only: no other object can go either
                continue
            if outcome is None:
                gone += 1
                gone_bytes += size
            elif outcome:
                removed += 1
                freed += size
    failures.summarize()
    if removed:
        logger.info("gc removed %d objects (%d bytes) from %s", removed, freed, layout.root)
    return GcReport(max_bytes=max_bytes, removed=removed, freed_bytes=freed,
                    kept=len(entries) - removed - gone, kept_bytes=total - freed - gone_bytes)


def _seen(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells an object's file apart from a later one at its name: device, inode,
    mtime (the recency stamp) and ctime (moved by a stamp, a link, a rename, and set
    afresh for a new file that reuses a freed inode number)."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _remove_unchanged(layout: PoolLayout, sha: str,
                      seen: tuple[int, int, int, int]) -> bool | None:
    """Remove the object ``sha`` if it is still the file a scan found (``seen``:
    :func:`_seen` of it then): True when removed, False when it changed since (kept),
    None when it is gone. The fan-out directory is opened without following a
    link, so a directory replaced by a link since the scan is never walked through.

    Raises:
        OSError: the object cannot be looked at or removed.
    """
    try:
        fd = os.open(layout.fanout(sha), DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # now a link: what it leads to is not this pool's
            return None
        raise
    try:
        st = os.stat(sha, dir_fd=fd, follow_symlinks=False)
        if _seen(st) != seen:
            return False
        os.unlink(sha, dir_fd=fd)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)
    return True


class _Failures:
    """The objects a collection could not remove: the first :attr:`SHOWN` logged one
    by one, the rest counted and logged once, with their causes, by
    :meth:`summarize` (a pool of another user's 100,000 objects is one paragraph of
    warnings, not 100,000 lines)."""

    SHOWN = 3

    def __init__(self, root: Path) -> None:
        self.root = root
        self.count = 0
        self.causes: dict[str, int] = {}

    def add(self, path: str, exc: OSError) -> None:
        """``path`` could not be removed, for ``exc``."""
        self.count += 1
        cause = exc.strerror or str(exc)
        self.causes[cause] = self.causes.get(cause, 0) + 1
        if self.count <= self.SHOWN:
            logger.warning("cannot remove %s during gc: %s", path, cause)

    def summarize(self) -> None:
        """Log the failures not logged one by one, if any."""
        if self.count <= self.SHOWN:
            return
        causes = ", ".join(f"{cause}: {n}" for cause, n in sorted(self.causes.items()))
        logger.warning("gc could not remove %d objects from %s in all (%s); %d more than "
                       "shown above", self.count, self.root, causes, self.count - self.SHOWN)


def verify(store: ObjectStore) -> VerifyReport:
    """Hash every object of ``store`` (in chunks: a huge file is never held in memory
    whole); quarantine the corrupt ones, counting apart those moved and those that
    could not be moved (a read-only pool) and are still in place. An object's name
    that holds no regular file (a symlink, a directory, a fifo, a device) is corrupt
    too: readers already treat it as a miss, so left in place it would hide the
    artifact for good while the report said the pool was whole.

    Raises:
        PoolError: the pool cannot be listed (a fan-out directory this user may not
            list: after the others are verified) or an object cannot be read.
    """
    from distcache.store._report import VerifyReport  # the report, with the call

    ok = corrupt = moved = ok_bytes = 0
    unlisted: list[tuple[str, OSError]] = []
    for path, sha, st in list(store.scan(unlisted)):
        before = store.quarantined
        size = _check(store, sha)
        if size is not None:
            ok += 1
            ok_bytes += size
        elif store.quarantined > before:
            corrupt += 1
            moved += 1
        elif _same_file(path, st):
            # Found bad and still there: it could not be moved. An object that is
            # simply gone (collected or pruned meanwhile) is neither.
            corrupt += 1
    for path, sha, st in _not_regular(store.layout):
        # Renamed, never followed nor deleted: a symlink goes to quarantine/ itself
        # (its target is left alone), a directory whole; only while it is still the
        # entry found here.
        before = store.quarantined
        store.quarantine(sha, f"is {_kind(st)}, not a regular file", st)
        if store.quarantined > before:
            corrupt += 1
            moved += 1
        elif _same_file(path, st):
            corrupt += 1
    if unlisted:
        # A pool cannot be called whole while part of it was not read.
        raise PoolError(
            f"verified {ok + corrupt} objects of {store.layout.root} ({corrupt} corrupt), "
            f"but {_said(unlisted)}: the objects in them were not verified; this user "
            "must be able to list every directory of objects/ (check the owner and "
            "mode of each, and the umask of the users who share the pool)",
            path=unlisted[0][0], errno=unlisted[0][1].errno)
    return VerifyReport(ok=ok, corrupt=corrupt, quarantined=_count(store.layout.quarantine),
                        ok_bytes=ok_bytes, moved=moved)


def _check(store: ObjectStore, sha: str) -> int | None:
    """The size of the object ``sha`` when its bytes, hashed in chunks, are its name;
    None when it is absent or they are not (then it is quarantined, as a read does).
    :class:`PoolError` when it cannot be read."""
    path = store.layout.object_path(sha)
    try:
        opened = open_object(store.layout.fanout(sha), sha, path)
    except NotAnObject as bad:
        store.quarantine(sha, bad.reason, bad.st)
        return None
    if opened is None:
        return None
    fd, st = opened
    try:
        digest, size = hash_fd(fd, st.st_size)
    except OSError as exc:
        raise pool_error("cannot read object", path, exc) from exc
    finally:
        os.close(fd)
    if (digest, size) != (sha, st.st_size):
        store.quarantine(sha, f"fails verification ({size} bytes)", st)
        return None
    return size


def _not_regular(layout: PoolLayout) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(path, sha, lstat)`` of each entry in ``objects/<xx>/`` named for a sha that
    belongs there and that is not a regular file (:func:`scan_objects` lists the
    regular ones). Each fan-out directory is listed through a descriptor opened
    without following a link, so a planted ``objects/<xx>`` symlink is not walked.

    Raises:
        PoolError: the objects directory cannot be listed.
    """
    for prefix in _fanouts(layout):
        try:
            fd = os.open(layout.objects / prefix, DIR_FLAGS)
        except OSError:
            continue
        found = []
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    if not (is_sha(entry.name) and layout.fanout_name(entry.name) == prefix):
                        continue
                    with contextlib.suppress(OSError):  # gone meanwhile: not ours to judge
                        st = entry.stat(follow_symlinks=False)
                        if not stat.S_ISREG(st.st_mode):
                            found.append((entry.name, st))
        except OSError:
            continue
        finally:
            os.close(fd)
        for name, st in found:
            yield layout.object_path(name), name, st


def _fanouts(layout: PoolLayout) -> list[str]:
    try:
        with os.scandir(layout.objects) as it:
            return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise pool_error("cannot list", layout.objects, exc) from exc


def _kind(st: os.stat_result) -> str:
    """What a non-regular file is, for the quarantine's log line."""
    for test, kind in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(st.st_mode):
            return kind
    return "an unknown kind of file"


def _same_file(path: str, st: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)


def stats(layout: PoolLayout, *, pool_id: str, names: int | Mapping[str, str],
          max_bytes: int | None) -> PoolStats:
    """Counts from a directory scan of the pool at ``layout`` (no hashing); of the
    labels ``names`` (name to sha), those whose object the scan found (a label of a
    collected object names nothing; a number is reported as given); the pool's
    ``pool_id`` and ``max_bytes`` as given.

    Raises:
        PoolError: the pool cannot be listed.
    """
    from distcache.store._report import PoolStats  # the report, with the call

    size = 0
    present = set()
    unlisted: list[tuple[str, OSError]] = []
    for _path, sha, st in scan_objects(layout, unlisted):
        present.add(sha)
        size += st.st_size
    count, labelled = len(present), names if isinstance(names, int) else sum(
        1 for sha in names.values() if sha in present)
    _warn_unlisted(unlisted, "not counted")
    return PoolStats(root=layout.root, pool_id=pool_id, objects=count, bytes=size,
                     quarantined=_count(layout.quarantine), tmp_files=_count(layout.tmp),
                     names=labelled, max_bytes=max_bytes)


def _said(unlisted: list[tuple[str, OSError]]) -> str:
    """``cannot list D1 (why), D2 (why) ... and N more`` for fan-out directories."""
    shown = ", ".join(f"{path} ({exc.strerror or exc})" for path, exc in unlisted[:3])
    more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
    return f"cannot list {len(unlisted)} directories of objects/: {shown}{more}"


def _warn_unlisted(unlisted: list[tuple[str, OSError]], what: str) -> None:
    """Say that the objects of the fan-out directories in ``unlisted`` were ``what``."""
    if unlisted:
        logger.warning("%s; the objects in them were %s", _said(unlisted), what)


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
        try:
            taken = lock.acquire() and lock.held
        except PoolError as exc:  # not a lock file (a socket, an I/O error): left alone
            logger.debug("not sweeping %s: %s", path, exc)
            continue
        if taken and lock.release():
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

