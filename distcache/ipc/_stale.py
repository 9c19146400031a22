"""Segment names in ``/dev/shm`` that producers which died before unlinking them left.

A producer unlinks its segment's name once its consumers have mapped it (after the
exchange barrier). One killed before that (SIGKILL, the OOM killer, a preempted job)
leaves the name, and with it the segment's memory, until the host reboots; a job
restarted in a loop would fill ``/dev/shm``. So the producer holds an exclusive
``flock`` on its segment from creation until it unlinks the name (:func:`hold`,
:func:`release`). The lock lives as long as a descriptor of the open file does: the
process's, or that of a child it forked meanwhile.

:func:`sweep_stale`, run before a new segment is made, removes a name that is this
user's, a regular file, unchanged for :data:`STALE_AFTER_S` (a creator opens before it
locks; it also spares a segment an older distcache, which locks nothing, still
writes), and that nobody holds locked. Another user's name, a link or anything else is
left alone, and a name replaced while it was looked at is not removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import time

from distcache._log import get_logger
from distcache.errors import PoolError
from distcache.store._fs import unlink_quietly

log = get_logger(__name__)

#: The names distcache's segments have in ``/dev/shm``.
NAME_RE = re.compile(r"\Adistcache\.[A-Za-z0-9._-]{1,100}\Z")

#: How long a name must have been unchanged before an unlocked one counts as stale.
STALE_AFTER_S = 10.0


def hold(fd: int, path: str) -> None:
    """Lock the new segment ``fd`` (at ``path``) for as long as it is open.

    Raises:
        PoolError: the lock cannot be taken.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise PoolError(f"cannot lock the new segment {path}: {exc}", path=path) from exc


def release(path: str, fd: int) -> None:
    """Unlink ``path``, then close its held descriptor ``fd``; never raises."""
    unlink_quietly(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def sweep_stale(shm_dir: str, *, older_than: float = STALE_AFTER_S) -> list[str]:
    """Remove the stale segment names of this user under ``shm_dir`` (see the module
    docstring); the names removed. Never raises: a name that cannot be looked at is
    left where it is."""
    try:
        names = [n for n in os.listdir(shm_dir) if NAME_RE.match(n)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(shm_dir, name)
        if _remove_if_stale(path, older_than):
            removed.append(name)
    return removed


def _remove_if_stale(path: str, older_than: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone, a link, or not ours to open
    try:
        seen = os.fstat(fd)
        if not stat.S_ISREG(seen.st_mode) or seen.st_uid != os.geteuid():
            return False
        if time.time() - max(seen.st_mtime, seen.st_ctime) < older_than:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: its producer (or a child of it) lives
        try:
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
            return False  # replaced meanwhile: not the file looked at
        try:
            os.unlink(path)
        except OSError as exc:
            log.debug("could not remove the stale segment %s: %s", path, exc)
            return False
        log.warning("removed %s (%d bytes): a segment whose producer ended before it "
                    "unlinked it", path, seen.st_size)
        return True
    finally:
        os.close(fd)
