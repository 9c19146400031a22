"""The pool's filesystem layer: how it opens, writes, publishes and moves files.

Pool roots are shared by users, hosts and crashed processes, so every call here
keeps a few rules:

- **Never follow a symlink inside the pool.** Files are opened with ``O_NOFOLLOW``
  (reads also with ``O_NONBLOCK``, so a planted FIFO cannot hang an open) and
  directories the pool writes into are checked with ``lstat``. Objects are opened
  relative to a descriptor of their fan-out directory ``objects/<xx>`` opened with
  ``O_NOFOLLOW``, so a symlink planted there or as an object is a miss for readers;
  publishers move it into ``quarantine/`` and refuse to write when they cannot: the
  pool's user never reads or writes through it.
- **Temporary files are process-unique and exclusive**: named for host, pid and
  random bits, created ``O_CREAT | O_EXCL | O_NOFOLLOW`` with mode ``0600``. A link
  planted at a guessed name makes the create fail instead of being written through,
  and nobody else reads a half-written file.
- **Publish whole files: write, fsync, link, then verify.** ``link(2)`` fails on an
  existing name, so the first publisher wins and a crash leaves no object or a whole
  one. A loser does not trust the winner blindly: it reads (so verifies) what is
  there and, if that was corrupt and moved aside, links again. Where ``link`` is
  refused (some FUSE, SMB) an atomic ``rename`` replaces instead.
- **Shared pools.** Everything is created with the process umask applied (objects
  ``0o444``, logs and locks ``0o666``, directories ``0o777``, less the umask), so a
  team pool works with ``umask 002``. Under a set-gid root Linux gives new
  directories the root's group and set-gid bit; the pool re-adds the bit where a
  platform does not, so the whole group can keep writing new fan-out directories.

Failures become :class:`~distcache.errors.PoolError` through :func:`pool_error`,
here and in the layers above (:mod:`distcache.store._pool`, :mod:`distcache.store._log`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from distcache.errors import PoolError

__all__ = ["APPEND_FLAGS", "CREATE_FLAGS", "DIR_FLAGS", "NO_LINK", "READ_FLAGS", "NotAnObject",
           "fsync_dir", "is_hex", "is_sha", "link_into_place", "load_pool_id", "make_dir",
           "materialize_file", "move_aside", "open_fanout", "pool_error", "process_umask",
           "read_fd", "read_object", "scan_objects", "temp_file", "unlink_quietly",
           "write_all"]

logger = logging.getLogger(__name__)

#: How the pool opens files to read them: never through a symlink, never blocking.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
#: How it creates temporary files: exclusively, never through a symlink.
CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: How it appends to its logs.
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
# Readers open the fan-out directory rather than walk through it by path: O_NOFOLLOW
# on that component keeps a planted objects/<xx> symlink from being followed.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: link(2) is not offered everywhere (some FUSE, SMB); rename is the fallback there.
NO_LINK = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})
_HEX = frozenset("0123456789abcdef")


def is_hex(text: str, length: int) -> bool:
    """Whether ``text`` is ``length`` lowercase hex digits (no exception, for scans)."""
    return len(text) == length and _HEX.issuperset(text)


def is_sha(text: str) -> bool:
    """Whether ``text`` has the shape of a sha256 hex digest."""
    return is_hex(text, 64)


def pool_error(what: str, path: str | os.PathLike[str], exc: OSError) -> PoolError:
    """``exc`` as a :class:`PoolError` saying what failed and where."""
    return PoolError(
        f"{what} {os.fspath(path)}: {exc.strerror or exc}", path=os.fspath(path), errno=exc.errno
    )


def process_umask() -> int:
    """The process umask, read without changing it where the platform allows."""
    # Reading the umask with os.umask() briefly changes it for every thread;
    # /proc says it without side effects (Linux >= 4.7).
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_fd(fd: int, size: int) -> bytes:
    """Read a file whose ``fstat`` said ``size`` bytes."""
    # Ask for one byte more than fstat promised: a file that grew shows up as too
    # long (and fails verification) without a second read call.
    data = os.read(fd, size + 1)
    if len(data) >= size:
        return data
    parts = [data]
    got = len(data)
    while got <= size:
        chunk = os.read(fd, size + 1 - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries, where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; rename is still atomic
    finally:
        os.close(fd)


def unlink_quietly(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` if it can be removed; a cleanup never raises."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def make_dir(path: Path, *, setgid: bool) -> None:
    """Create ``path`` unless it exists (re-adding set-gid when ``setgid``) and check
    that it is a real directory; :class:`PoolError` when not."""
    try:
        os.mkdir(path, 0o777)
        if setgid and not os.stat(path).st_mode & stat.S_ISGID:
            # Best effort: group inheritance is a convenience, not a need.
            with contextlib.suppress(OSError):
                os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) | stat.S_ISGID)
    except FileExistsError:
        pass
    except OSError as exc:
        raise pool_error("cannot create directory", path, exc) from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise pool_error("cannot stat", path, exc) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise PoolError(
            f"{path} is not a directory (a symlink or file?); the pool will not "
            "follow it. Remove it or use another pool root.",
            path=str(path),
        )


def open_fanout(path: str) -> int | None:
    """A descriptor of the fan-out directory ``path``, or None when it is absent or
    not a real directory (a miss for readers; a publisher moves it aside, or fails
    in :func:`make_dir`). :class:`PoolError` when it cannot be opened."""
    try:
        return os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise pool_error("cannot open", path, exc) from exc
    logger.warning("%s is not a directory (a planted symlink?); not following it", path)
    return None


class NotAnObject(Exception):
    """An object's name holds a symlink or a non-file; ``st`` is its ``fstat``."""

    def __init__(self, reason: str, st: os.stat_result | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.st = st


def read_object(fanout: str, name: str, stamp_after: float | None
                ) -> tuple[bytes, os.stat_result] | None:
    """The bytes (not yet verified) and ``fstat`` of ``fanout/name``, or None when
    absent. The file is opened relative to an ``O_NOFOLLOW`` descriptor of
    ``fanout``; its mtime is refreshed when older than ``stamp_after`` seconds.

    Raises:
        NotAnObject: it is a symlink or not a regular file.
        PoolError: it exists but cannot be read (permissions, I/O error).
    """
    directory = open_fanout(fanout)
    if directory is None:
        return None
    path = f"{fanout}{os.sep}{name}"
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotAnObject("is a symlink", None) from None
        raise pool_error("cannot open object", path, exc) from exc
    finally:
        os.close(directory)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAnObject("is not a regular file", st)
        data = read_fd(fd, st.st_size)
        if stamp_after is not None and time.time() - st.st_mtime > stamp_after:
            # Another user's object may refuse: recency falls back to publish time.
            with contextlib.suppress(OSError):
                os.utime(fd)
    except OSError as exc:
        raise pool_error("cannot read object", path, exc) from exc
    finally:
        os.close(fd)
    return data, st


def temp_file(directory: str | os.PathLike[str], tag: str, host: str) -> tuple[int, str]:
    """A new ``0600`` file, exclusively created in ``directory`` (its fd and path);
    :class:`PoolError` when it cannot be (a planted link at its name included)."""
    name = f"{tag}.{host}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    path = os.path.join(directory, name)
    try:
        return os.open(path, CREATE_FLAGS, 0o600), path
    except OSError as exc:
        raise pool_error("cannot create temporary file", path, exc) from exc


def link_into_place(tmp: str, final: str, existing_is_good: Callable[[], bool]) -> bool:
    """Link the whole, fsynced ``tmp`` to ``final``; whether this call published it.
    An existing ``final`` wins unless ``existing_is_good()`` (which verifies it and
    moves a bad one aside) says otherwise; then the link is tried once more."""
    for _attempt in range(2):
        try:
            os.link(tmp, final)
            return True
        except FileExistsError:
            if existing_is_good():
                return False
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            os.replace(tmp, final)
            return True
    return False


def load_pool_id(path: Path, *, tmp_dir: Path, host: str, mode: int) -> str:
    """The pool id in ``path``, creating it first when absent.

    Raises:
        PoolError: it cannot be read or created, or holds something else.
    """
    for _ in range(50):
        try:
            fd = os.open(path, READ_FLAGS)
        except FileNotFoundError:
            _create_once(path, f"{secrets.token_hex(16)}\n".encode("ascii"), tmp_dir, host, mode)
            continue
        except OSError as exc:
            raise pool_error("cannot read pool id", path, exc) from exc
        try:
            text = os.read(fd, 256).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        if is_hex(text, 32):
            return text
        if text:
            raise PoolError(
                f"{path} holds {text[:40]!r}, not a pool id (32 hex digits); "
                "the pool root may be something else",
                path=str(path),
            )
        time.sleep(0.01)  # a creator on a no-hardlink filesystem is mid-write
    raise PoolError(f"{path} stays empty; remove it to let the pool recreate it",
                    path=str(path))


def _create_once(path: Path, data: bytes, tmp_dir: Path, host: str, mode: int) -> None:
    # Write a whole file elsewhere, then link it into place: concurrent creators
    # race on link(2), exactly one wins, and everyone reads the winner's file.
    fd, tmp = temp_file(tmp_dir, path.name, host)
    try:
        write_all(fd, data)
        os.fchmod(fd, mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            try:
                fd2 = os.open(path, CREATE_FLAGS, mode)
            except FileExistsError:
                return
            try:
                write_all(fd2, data)
                os.fsync(fd2)
            finally:
                os.close(fd2)
        fsync_dir(path.parent)
    except OSError as exc:
        raise pool_error("cannot create pool id", path, exc) from exc
    finally:
        if fd >= 0:
            os.close(fd)
        unlink_quietly(tmp)


def move_aside(path: str, quarantine: Path, sha: str, st: os.stat_result | None) -> Path | None:
    """Move the object ``path`` into ``quarantine`` and return where it went; None
    when it is gone or, ``st`` given, no longer the inode found bad (repaired)."""
    try:
        now = os.lstat(path)
        if st is not None and (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            return None
        dest = quarantine / f"{sha}.{time.time_ns()}.{os.getpid()}.{secrets.token_hex(3)}"
        os.rename(path, dest)
    except FileNotFoundError:
        return None
    return dest


def scan_objects(objects: Path) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(path, sha, lstat)`` of each regular file in ``objects/<xx>/`` named for a
    sha that belongs there; :class:`PoolError` when ``objects`` cannot be listed."""
    try:
        prefixes = sorted(e.name for e in os.scandir(objects) if e.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise pool_error("cannot list", objects, exc) from exc
    for prefix in prefixes:
        try:
            entries = list(os.scandir(objects / prefix))
        except OSError:
            continue
        for entry in entries:
            if not (is_sha(entry.name) and entry.name[:2] == prefix):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield entry.path, entry.name, st


def materialize_file(obj: str, into: Path, target: Path, sha: str, data: bytes,
                     mode: int) -> None:
    """Place verified object ``obj`` (bytes ``data``) at ``target`` under ``into``: a
    hard link, else a ``mode`` copy, renamed into place; a correct target is kept.
    :class:`PoolError` for a symlinked directory on the way, OSError on failure."""
    _ensure_dirs(into, target.parent)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode):
        ost = os.lstat(obj)
        if (st.st_ino, st.st_dev) == (ost.st_ino, ost.st_dev):
            return
        if st.st_size == len(data) and _file_matches(target, sha):
            return
    tmp = os.path.join(target.parent, f".{target.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        try:
            os.link(obj, tmp)
        except OSError as exc:
            if exc.errno != errno.EXDEV and exc.errno not in NO_LINK:
                raise
            fd = os.open(tmp, CREATE_FLAGS, 0o600)
            try:
                write_all(fd, data)
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, target)
    finally:
        unlink_quietly(tmp)


def _ensure_dirs(into: Path, parent: Path) -> None:
    # The caller's directory may be a symlink (they named it); below it, every
    # directory of the name is created or checked with lstat, so a planted
    # symlink cannot carry the write outside ``into``.
    os.makedirs(into, exist_ok=True)
    current = into
    for part in parent.relative_to(into).parts:
        current = current / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(current, 0o777)
        if not stat.S_ISDIR(os.lstat(current).st_mode):
            raise PoolError(
                f"{current} is not a directory (a symlink?); refusing to write through it",
                path=str(current),
            )


def _file_matches(path: Path, sha: str) -> bool:
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        data = read_fd(fd, st.st_size)
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(data) == st.st_size and hashlib.sha256(data).hexdigest() == sha
