"""The pool's file primitives: how it opens, creates and places files safely.

Pool roots are shared by users, hosts and crashed processes, so every call here keeps
a few rules (the object-level rules built on them are in :mod:`distcache.store._objects`):

- **Never follow a symlink the pool did not create.** Files are opened with
  ``O_NOFOLLOW`` (reads and appends also with ``O_NONBLOCK``, so a planted FIFO cannot
  hang an open) and directories the pool writes into are checked with ``lstat``.
- **Temporary files are process-unique and exclusive**: named for host, pid and
  random bits, created ``O_CREAT | O_EXCL | O_NOFOLLOW`` with mode ``0600``. A link
  planted at a guessed name makes the create fail instead of being written through,
  and nobody else reads a half-written file.
- **Small files written once** (``pool_id``, ``format``) are written whole elsewhere
  and linked into place: concurrent creators race on ``link(2)``, exactly one wins,
  and everyone reads the winner's file. Where ``link`` is refused (some FUSE, SMB) an
  exclusive create stands in: readers wait out its empty state, or remove one abandoned.
- **Shared pools.** Everything is created with the process umask applied (objects
  ``0o444``, logs and locks ``0o666``, directories ``0o777``, less the umask), so a
  team pool works with ``umask 002``. Under a set-gid root Linux gives new
  directories the root's group and set-gid bit; the pool re-adds the bit where a
  platform does not, so the whole group can keep writing new fan-out directories.

Failures become :class:`~distcache.errors.PoolError` through :func:`pool_error`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from distcache.errors import PoolError
from distcache.store._locking import FileLock

#: How the pool opens files to read them: never through a symlink, never blocking.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
#: How it creates temporary files: exclusively, never through a symlink.
CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: How it appends to its logs: never through a symlink, never blocking (a FIFO).
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
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
    return PoolError(f"{what} {os.fspath(path)}: {exc.strerror or exc}", path=os.fspath(path),
                     errno=exc.errno)


def process_umask() -> int:
    """The process umask, read without changing it where the platform allows."""
    # os.umask() changes it for every thread while it reads; /proc does not (Linux >= 4.7).
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
    # One byte more than fstat said: a file that grew reads as too long (failing checks).
    data = os.read(fd, size + 1)
    if len(data) >= size:
        return data
    parts, got = [data], len(data)
    while got <= size and (chunk := os.read(fd, size + 1 - got)):
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


#: Chunks :func:`hash_fd` reads: a huge file is hashed without holding it in memory.
CHUNK_BYTES = 1 << 20


def hash_fd(fd: int, size: int) -> tuple[str, int]:
    """The sha256 of the bytes of ``fd`` (up to one more than the ``size`` its ``fstat``
    said) and their count, read in chunks at their offsets: never all in memory."""
    digest, got, buf = hashlib.sha256(), 0, memoryview(bytearray(min(CHUNK_BYTES, size + 1)))
    while got <= size and (count := os.preadv(fd, [buf[: size + 1 - got]], got)):
        digest.update(buf[:count])
        got += count
    return digest.hexdigest(), got


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


#: What a filesystem that does not flush directories answers their fsync with.
_NO_DIR_FSYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS,
                           errno.EBADF})


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries; :class:`PoolError` when it cannot be opened or flushed,
    but not when it is gone or its filesystem refuses to fsync directories (rename is atomic)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # gone (collected, or the pool removed): nothing of it to flush
    except OSError as exc:  # out of descriptors, an I/O error: not flushed, so say so
        raise pool_error("cannot open to flush the directory", path, exc) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_FSYNC:
            raise pool_error("cannot flush directory", path, exc) from exc
    finally:
        os.close(fd)


@functools.cache
def _syncfs() -> object | None:
    """libc's ``syncfs`` (Linux), or None where the platform has none."""
    import ctypes  # with the first flush

    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


def sync_filesystem(path: str | os.PathLike[str]) -> bool:
    """Flush the whole filesystem holding ``path`` with one ``syncfs(2)``; False where the
    platform has none (the caller then fsyncs file by file). One call costs what a few
    ``fsync`` do, whatever was written since: a batch of thousands of small objects pays
    for its durability once. OSError when ``path`` cannot be opened or the flush failed."""
    call = _syncfs()
    if call is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if call(fd) != 0:  # type: ignore[operator]
            import ctypes

            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), os.fspath(path))
    finally:
        os.close(fd)
    return True


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync the regular file at ``path`` (never through a symlink); OSError on failure."""
    fd = os.open(path, READ_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` if it can be removed; a cleanup never raises."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def make_dir(path: Path, *, setgid: bool) -> bool:
    """Create ``path`` unless it exists (re-adding set-gid when ``setgid``); whether this
    call created it. :class:`PoolError` when it cannot be, or is not a real directory."""
    created = False
    try:
        os.mkdir(path, 0o777)
        created = True
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
        raise PoolError(f"{path} is not a directory (a symlink or file?); the pool will "
                        "not follow it. Remove it or use another pool root.", path=str(path))
    return created


def make_fanout(path: Path, *, setgid: bool, flush: bool = True) -> bool:
    """Create the fan-out directory ``path`` unless it exists, as :func:`make_dir` does;
    whether this call created it. With ``flush``, its parent (``objects/``) is fsynced
    before anything is published into it: else a power loss may take the new entry, and
    every object reported published there. In a batch (``flush=False``) the batch's flush
    covers it (:meth:`~distcache.store._durability.Durability.flush`). :class:`PoolError`
    when it cannot be created, is not a real directory, or the flush failed; then the
    new, empty directory is removed where it can be, so the next publication flushes it."""
    if not make_dir(path, setgid=setgid):
        return False
    if flush:
        try:
            fsync_dir(path.parent)
        except PoolError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise
    return True


def withdraw(path: str, fd: int) -> None:
    """Remove ``path`` if it is still the file open as ``fd``: a publication that
    failed after its link (a flush) leaves no object, as one that failed before it."""
    with contextlib.suppress(OSError):
        st, mine = os.lstat(path), os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(path)


def temp_file(path: str) -> int:
    """A new ``0600`` file at ``path`` (a fresh name), created exclusively; :class:`PoolError`
    when it cannot be (a planted link at its name included)."""
    try:
        return os.open(path, CREATE_FLAGS, 0o600)
    except OSError as exc:
        raise pool_error("cannot create temporary file", path, exc) from exc


def replace_from(fd: int, tmp: str | os.PathLike[str], target: str | os.PathLike[str],
                 data: bytes, mode: int) -> os.stat_result:
    """``data`` into ``fd`` (:func:`temp_file` at ``tmp``), ``mode``, fsync, over ``target``."""
    write_all(fd, data)
    os.fchmod(fd, mode)
    os.fsync(fd)
    os.replace(tmp, target)
    return os.fstat(fd)


#: Seconds an empty write-once file is waited out, and after which one untouched is abandoned.
EMPTY_WAIT_SECONDS, ABANDONED_EMPTY_SECONDS = 5.0, 60.0


def read_small_file(path: Path, what: str) -> str | None:
    """The stripped ASCII text of the small, write-once file ``path`` (``what`` it holds
    names it in errors), or None when absent. An empty file is a creator between its create
    and its write: it is waited out, or once abandoned (no live creator is that slow)
    removed, and None returned for the caller to create it again by :func:`create_once`'s
    rule. :class:`PoolError` when it cannot be read or removed, or stays empty."""
    deadline, delay = time.monotonic() + EMPTY_WAIT_SECONDS, 0.005
    while True:
        try:
            fd = os.open(path, READ_FLAGS)
            try:
                text, st = os.read(fd, 256).decode("ascii", "replace").strip(), os.fstat(fd)
            finally:
                os.close(fd)
            if text:
                return text
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime >= ABANDONED_EMPTY_SECONDS:
                locks = path.parent / "locks"
                make_dir(locks, setgid=bool(os.stat(path.parent).st_mode & stat.S_ISGID))
                lock = FileLock(locks / f"{path.name}.empty.lock", timeout=10.0)
                try:  # one process removes it, the others find its successor and keep that
                    if lock.acquire() and witness(os.lstat(path))[:4] == witness(st)[:4]:
                        os.unlink(path)  # unflushed: one back after a crash is abandoned again
                finally:
                    lock.release()
        except FileNotFoundError:
            return None
        except PoolError:
            raise
        except OSError as exc:
            raise pool_error(f"cannot read {what}", path, exc) from exc
        if time.monotonic() >= deadline:
            raise PoolError(f"{path} stays empty; it is recreated once untouched for "
                            f"{ABANDONED_EMPTY_SECONDS:g}s, or remove it", path=str(path))
        time.sleep(delay := min(delay * 2, 0.5))  # backing off: 10 ms, 20 ms, ... 0.5 s


def create_once(path: Path, data: bytes, *, tmp: str, mode: int, what: str) -> bool:
    """Create ``path`` holding ``data`` unless it exists; whether this call created
    it. The file appears whole (written at the fresh temporary name ``tmp``, then
    linked; where links are refused, created exclusively, then written) and exactly one
    of any number of concurrent creators wins. :class:`PoolError` when it cannot be
    created (``what`` it holds names it)."""
    fd = temp_file(tmp)
    try:
        write_all(fd, data)
        os.fchmod(fd, mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            try:  # the finally below closes it
                fd = os.open(path, CREATE_FLAGS, mode)
            except FileExistsError:
                return False
            write_all(fd, data)
            os.fsync(fd)
        fsync_dir(path.parent)
        return True
    except OSError as exc:
        raise pool_error(f"cannot create {what}", path, exc) from exc
    finally:
        if fd >= 0:
            os.close(fd)
        unlink_quietly(tmp)


#: What a verified object's file was: (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns).
Witness = tuple[int, int, int, int, int]


def witness(st: os.stat_result) -> Witness:
    """The :data:`Witness` of a file's ``stat``."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def trusted_file(st: os.stat_result, seen: Witness | None) -> bool:
    """Whether a file whose ``fstat`` is ``st`` is still the one verified as ``seen``:
    this user's (no one else can change it in place), same witness."""
    return seen is not None and st.st_uid == os.geteuid() and witness(st) == seen


#: How :func:`link_into_place` published: a hard link, or a rename where links are refused.
LINKED, REPLACED = "linked", "replaced"


def link_into_place(tmp: str, final: str, existing_is_good: Callable[[], bool]) -> str | None:
    """Link the whole, fsynced ``tmp`` to ``final``: :data:`LINKED` or :data:`REPLACED`
    when this call published it, else ``None``. An existing ``final`` wins unless
    ``existing_is_good()`` (which verifies it and moves a bad one aside) says otherwise;
    then the link is tried once more: a corrupt file there again is a ``FileExistsError``."""
    for _attempt in range(2):
        try:
            os.link(tmp, final)
            return LINKED
        except FileExistsError:
            if existing_is_good():
                return None
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            os.replace(tmp, final)
            return REPLACED
    raise FileExistsError(errno.EEXIST, "a corrupt file took its place again", final)


def move_aside(path: str, dest: Path, st: os.stat_result | None) -> bool:
    """Rename the bad object ``path`` to ``dest``; False when it is gone or what moved
    was not what was found bad (``st``'s inode; without ``st``, a symlink). The rename
    comes first and what it moved is checked after, so a repair that put a good file
    there meanwhile is never lost: that file is put back (dropped if yet another took
    its place), as no check before a rename could promise."""
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return False
    now = os.lstat(dest)
    if (st is None and stat.S_ISLNK(now.st_mode)) or (
            st is not None and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)):
        return True
    with contextlib.suppress(OSError):  # else it stays in quarantine/, a copy
        try:
            os.link(dest, path)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            os.rename(dest, path)  # a directory, or where links are refused
            return False
        os.unlink(dest)
    return False
