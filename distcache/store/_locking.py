"""Kernel file locks with a bounded wait, for economy only.

A lock here never decides correctness: the pool publishes by content address and
atomic rename, so two writers of one object produce the same bytes. A lock only
saves bandwidth by letting one process download while the others wait for it.
That shapes every choice below:

- ``flock(2)`` on a file opened with ``O_NOFOLLOW``: the kernel drops the lock when
  the holder dies (even by ``kill -9``), so there is no stale lock file that blocks
  forever, the classic failure of lock-by-existence schemes on shared caches.
  ``flock`` is per open file description, so two threads of one process exclude
  each other as well. On Linux NFS clients ``flock`` is emulated with byte-range
  locks and works across hosts.
- The wait is bounded: after ``timeout`` seconds :meth:`FileLock.acquire` returns
  ``False`` and the caller goes ahead without the lock (a duplicate download, never
  a hang).
- Where locking does not work (Lustre without ``-o flock``, some FUSE and CIFS
  mounts: ``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``) or the lock file cannot be
  created (a read-only pool), the lock degrades to no lock. That is logged once per
  directory, not once per object. A directory or socket found at a lock's path
  costs that one lock, logged each time.
- A holder may remove the lock file when it releases (``remove_on_release``) so that
  lock files do not pile up; an acquirer therefore checks, after locking, that the
  path still names the inode it locked, and starts over when it does not. A holder
  removes the file only while the path still names its inode: a file that replaced
  it (someone removed the holder's) belongs to another holder.

A process that ``fork``s while holding a lock shares it with the child; the lock
fd is opened ``O_CLOEXEC`` so an ``exec`` does not carry it further.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time

from distcache._log import get_logger
from distcache.errors import PoolError

logger = get_logger(__name__)

# Errors that mean "this filesystem does not do locks", as opposed to "someone holds it".
_UNSUPPORTED = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})
_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
# Errors opening the lock file that only cost us the lock, not the operation.
_CANNOT_CREATE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# Errors opening it that mean something other than a file is there (a directory, a
# socket): that one lock is lost, the operation goes on.
_NOT_A_FILE = frozenset({errno.EISDIR, errno.ENXIO})
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_MAX_POLL = 0.05

# Directories already warned about: once per process, like the log it goes to.
_warned_dirs: set[str] = set()
_warned_guard = threading.Lock()


def _warn_degraded(path: str, why: str) -> None:
    directory = os.path.dirname(path)
    with _warned_guard:
        if directory in _warned_dirs:
            return
        _warned_dirs.add(directory)
    logger.warning(
        "file locks unavailable in %s (%s); continuing without them: concurrent "
        "processes may download the same artifact twice, which is safe",
        directory,
        why,
    )


def flock_fd(fd: int, timeout: float, *, path: str = "") -> bool | None:
    """Take an exclusive ``flock`` on ``fd``, waiting at most ``timeout`` seconds.

    Returns ``True`` when locked, ``False`` on timeout, ``None`` when the filesystem
    does not support locks (logged once per directory of ``path``).

    Raises:
        PoolError: an unexpected error from ``flock``.
    """
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                _warn_degraded(path, os.strerror(exc.errno or 0))
                return None
            if exc.errno not in _BUSY:
                raise PoolError(
                    f"cannot lock {path or f'fd {fd}'}: {exc.strerror}", path=path
                ) from exc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, _MAX_POLL)


class FileLock:
    """An exclusive, kernel-released lock on ``path`` with a bounded wait.

    ``acquire`` returns ``True`` when the caller may proceed as the only holder (or
    as one of several lock-less callers where locks do not work: then ``degraded``
    is true) and ``False`` when ``timeout`` passed while someone else held it.
    The file is created with mode ``0o666`` less the umask, so a group-writable
    shared pool (umask 002) gets group-writable lock files.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, timeout: float, remove_on_release: bool = False
    ) -> None:
        if timeout < 0:
            raise ValueError(f"lock timeout must be >= 0, got {timeout!r}")
        self.path = os.fspath(path)
        self.timeout = timeout
        self.remove_on_release = remove_on_release
        self.degraded = False
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds a kernel lock right now."""
        return self._fd is not None

    def _open(self) -> int | None:
        for _ in range(2):
            try:
                return os.open(self.path, _OPEN_FLAGS, 0o666)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    # A symlink planted where a lock file belongs: never follow it.
                    # Removing the link itself is safe (unlink does not follow).
                    logger.warning("removing symlink found in place of lock %s", self.path)
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                    except OSError:
                        break
                    continue
                if exc.errno in _CANNOT_CREATE:
                    _warn_degraded(self.path, f"cannot create lock file: {exc.strerror}")
                    return None
                if exc.errno in _NOT_A_FILE:
                    logger.warning("%s is not a lock file (%s); going on without this lock",
                                   self.path, exc.strerror)
                    return None
                raise PoolError(
                    f"cannot open lock file {self.path}: {exc.strerror}", path=self.path
                ) from exc
        _warn_degraded(self.path, "lock path keeps turning into a symlink")
        return None

    def _still_named(self, fd: int) -> bool:
        """Whether the path still names the file open as ``fd`` (ESTALE: an NFS
        client's handle of a file removed on another client, so no).

        Raises:
            PoolError: the path or ``fd`` cannot be examined.
        """
        try:
            on_disk = os.stat(self.path, follow_symlinks=False)
            mine = os.fstat(fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESTALE):
                return False
            raise PoolError(f"cannot examine lock file {self.path}: {exc.strerror}",
                            path=self.path) from exc
        return (on_disk.st_ino, on_disk.st_dev) == (mine.st_ino, mine.st_dev)

    def acquire(self, timeout: float | None = None) -> bool:
        """Lock, waiting at most ``timeout`` (default: the constructor's) seconds.

        Raises:
            PoolError: the lock file cannot be opened or locked for an unexpected
                reason (not for "unsupported" or "read-only", which degrade).
            RuntimeError: this object already holds the lock.
        """
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} is already held by this object")
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            fd = self._open()
            if fd is None:
                self.degraded = True
                return True
            try:
                got = flock_fd(fd, max(0.0, deadline - time.monotonic()), path=self.path)
            except BaseException:
                os.close(fd)
                raise
            if got is None:
                os.close(fd)
                self.degraded = True
                return True
            if not got:
                os.close(fd)
                return False
            try:
                named = self._still_named(fd)
            except BaseException:
                os.close(fd)
                raise
            if named:
                self._fd = fd
                return True
            # The previous holder removed the file after we opened it: our lock is
            # on an orphaned inode. Start over on whatever the path names now.
            os.close(fd)

    def release(self) -> bool:
        """Unlock (and remove the file when ``remove_on_release``); whether the file
        was removed. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return False
        removed = False
        try:
            if self.remove_on_release:
                # Only the file this lock is on: one that replaced it (after someone
                # removed ours) may be another holder's.
                with contextlib.suppress(OSError):
                    if self._still_named(fd):
                        os.unlink(self.path)
                        removed = True
            # Unlock explicitly: a forked child sharing the fd would otherwise keep
            # the lock alive after our close.
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(fd)
        return removed

    def __repr__(self) -> str:
        state = "held" if self.held else ("degraded" if self.degraded else "free")
        return f"FileLock({self.path!r}, {state})"
