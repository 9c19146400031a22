"""ArtifactPool: the content-addressed artifact store on disk.

Layout under ``root``::

    pool_id                 stable identity, written once (atomically) at creation
    objects/<sha[:2]>/<sha> the bytes, read-only (0444 less the umask)
    tmp/                    process-unique temporary files; stale ones are swept
    quarantine/             objects that failed verification, kept for inspection
    locks/<sha>.lock        per-object download locks (kernel-released; economy only)
    names.log               append-only "name -> sha" labels, last entry wins
    journal.log             append-only list of shas published into this pool

Correctness never depends on a lock (DESIGN.md, "Artifacts and the pool"): every
read is verified, publication is write-to-unique-temp + fsync + ``link`` into place
(first publisher wins; content-addressed, so every publisher has the same bytes),
and a crash leaves either no object or a whole one.

Symlinks are never followed inside the pool: files are opened with ``O_NOFOLLOW``
(a symlinked object is quarantined) and directories the pool writes into are checked
with ``lstat``. Objects are read relative to a descriptor of their fan-out directory
opened with ``O_NOFOLLOW``, so a symlink planted as ``objects/<xx>`` is a miss for
readers and refused by publishers, never followed.

Shared pools: files and directories are created with the process umask applied
(objects ``0o444``, logs and locks ``0o666``, directories ``0o777``, all less the
umask), so a team pool works with ``umask 002`` and a set-gid root: Linux gives new
directories the root's group and set-gid bit, and the pool re-adds the bit where a
platform does not. Recency for LRU collection is the object's mtime, refreshed by
reads at most once per ``stamp_interval`` seconds (atime is useless on ``noatime``
mounts); a reader that may not touch another user's object simply skips the stamp.

The two logs live in :mod:`distcache.pool_log` and the whole-pool maintenance
(``gc``, ``verify``, ``stats``, ``sweep``) in :mod:`distcache.pool_maintenance`;
:class:`ArtifactPool` is the one public entry point to all of it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from distcache import pool_maintenance
from distcache.artifact import Artifact, check_sha256, path_under, validate_name
from distcache.config import settings
from distcache.errors import ConfigError, IntegrityError, PoolError
from distcache.locking import FileLock
from distcache.pool_log import READ_FLAGS, Journal, NamesIndex, is_hex, is_sha, pool_error
from distcache.pool_maintenance import STALE_TMP_SECONDS
from distcache.pool_report import GcReport, PoolStats, VerifyReport

__all__ = ["ArtifactPool", "GcReport", "PoolStats", "SupportsFetchInto", "VerifyReport"]

logger = logging.getLogger(__name__)

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Readers open the fan-out directory rather than walk through it by path: O_NOFOLLOW
# on that component keeps a planted objects/<xx> symlink from being followed.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# link(2) is not offered everywhere (some FUSE, SMB); rename is the fallback there.
_NO_LINK = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


class SupportsFetchInto(Protocol):
    """The part of the Origin protocol the pool uses."""

    def describe(self) -> str: ...

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int: ...


def _process_umask() -> int:
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


def _read_fd(fd: int, size: int) -> bytes:
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


def _fsync_dir(path: str) -> None:
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


class ArtifactPool:
    """A content-addressed, verified, crash-safe store of artifact bytes.

    Args:
        root: the pool directory (created if missing).
        max_bytes: size cap; least recently used objects are collected past it.
            Default: ``DISTCACHE_POOL_MAX_BYTES``, else unlimited.
        lock_timeout: seconds to wait for another process downloading the same
            object before downloading it too. Default: ``DISTCACHE_LOCK_TIMEOUT``.

    Raises:
        PoolError: the root or its layout cannot be created or is not a directory.
        ConfigError: a negative ``max_bytes``/``lock_timeout`` or a bad variable.
    """

    #: Reads refresh an object's recency stamp when it is older than this (seconds).
    stamp_interval: float = 60.0
    #: Quarantined files kept for inspection, newest first; older ones are deleted so
    #: that a medium that keeps corrupting objects cannot fill the disk with them
    #: (quarantine/ is outside the size cap).
    quarantine_keep: int = 16

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ConfigError(f"max_bytes must be >= 0, got {max_bytes}", variable="max_bytes",
                              value=max_bytes)
        if lock_timeout is not None and lock_timeout < 0:
            raise ConfigError(f"lock_timeout must be >= 0, got {lock_timeout}",
                              variable="lock_timeout", value=lock_timeout)
        resolved = settings(pool_max_bytes=max_bytes, lock_timeout=lock_timeout)
        self.max_bytes: int | None = resolved.pool_max_bytes
        self.lock_timeout: float = (
            lock_timeout if lock_timeout is not None else resolved.lock_timeout
        )
        self.root = Path(os.path.abspath(root))
        self.quarantined = 0
        umask = _process_umask()
        self._file_mode = 0o444 & ~umask
        self._guard = threading.Lock()
        self._approx_bytes: int | None = None
        self._host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname())
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._setgid = bool(os.stat(self.root).st_mode & stat.S_ISGID)
        except OSError as exc:
            raise pool_error("cannot create pool root", self.root, exc) from exc
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._quarantine = self.root / "quarantine"
        self._locks = self.root / "locks"
        for directory in (self._objects, self._tmp, self._quarantine, self._locks):
            self._make_dir(directory)
        self._objects_prefix = f"{self._objects}{os.sep}"
        self._names_index = NamesIndex(self.root / "names.log", 0o666)
        self._journal = Journal(self.root / "journal.log", 0o666)
        self.pool_id = self._load_pool_id()
        self.sweep()

    def __repr__(self) -> str:
        return f"ArtifactPool({str(self.root)!r}, pool_id={self.pool_id!r})"

    # -- layout -------------------------------------------------------------------

    def _make_dir(self, path: Path) -> None:
        try:
            os.mkdir(path, 0o777)
            if self._setgid and not os.stat(path).st_mode & stat.S_ISGID:
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

    def _object_path(self, sha: str) -> str:
        return f"{self._objects_prefix}{sha[:2]}{os.sep}{sha}"

    def _open_fanout(self, sha: str) -> int | None:
        """A descriptor of ``objects/<sha[:2]>``, or None when it is absent or is not
        a real directory (a planted symlink or file: a miss, and publishing into it
        fails in :meth:`_make_dir`)."""
        path = f"{self._objects_prefix}{sha[:2]}"
        try:
            return os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise pool_error("cannot open", path, exc) from exc
        logger.warning("%s is not a directory (a planted symlink?); not following it", path)
        return None

    def _load_pool_id(self) -> str:
        path = self.root / "pool_id"
        for _ in range(50):
            try:
                fd = os.open(path, READ_FLAGS)
            except FileNotFoundError:
                self._create_pool_id(path)
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

    def _create_pool_id(self, path: Path) -> None:
        # Write a whole file elsewhere, then link it into place: concurrent creators
        # race on link(2), exactly one wins, and everyone reads the winner's id.
        fd, tmp = self._temp_file("pool_id")
        try:
            os.write(fd, f"{secrets.token_hex(16)}\n".encode("ascii"))
            os.fchmod(fd, self._file_mode)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            try:
                os.link(tmp, path)
            except FileExistsError:
                return
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
                try:
                    fd2 = os.open(path, _CREATE, self._file_mode)
                except FileExistsError:
                    return
                with open(fd2, "wb") as out:
                    out.write(Path(tmp).read_bytes())
                    out.flush()
                    os.fsync(out.fileno())
            _fsync_dir(str(self.root))
        except OSError as exc:
            raise pool_error("cannot create pool id", path, exc) from exc
        finally:
            if fd >= 0:
                os.close(fd)
            self._unlink_quietly(tmp)

    def _temp_file(self, tag: str) -> tuple[int, str]:
        name = f"{tag}.{self._host}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        path = os.path.join(self._tmp, name)
        try:
            return os.open(path, _CREATE, 0o600), path
        except OSError as exc:
            raise pool_error("cannot create temporary file", path, exc) from exc

    @staticmethod
    def _unlink_quietly(path: str | os.PathLike[str]) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)

    # -- reading ------------------------------------------------------------------

    def has(self, sha256: str) -> bool:
        """Whether an object for ``sha256`` is present (no hashing; a later ``get``
        may still find it corrupt).

        Raises:
            ValueError: ``sha256`` is not 64 lowercase hex characters.
        """
        check_sha256(sha256)
        try:
            return stat.S_ISDIR(os.lstat(f"{self._objects_prefix}{sha256[:2]}").st_mode) and (
                stat.S_ISREG(os.lstat(self._object_path(sha256)).st_mode))
        except OSError:
            return False

    def get(self, sha256: str) -> bytes | None:
        """The verified bytes of ``sha256``, or ``None`` when absent or corrupt.

        A corrupt object (wrong bytes, truncated, a symlink or other non-file) is
        moved to ``quarantine/``, counted in :attr:`quarantined`, logged, and reported
        as a miss.

        Raises:
            ValueError: ``sha256`` is not 64 lowercase hex characters.
            PoolError: the object exists but cannot be read (permissions, I/O error).
        """
        check_sha256(sha256)
        return self._read(sha256, stamp=True)

    def _read(self, sha: str, *, stamp: bool) -> bytes | None:
        path = self._object_path(sha)
        directory = self._open_fanout(sha)
        if directory is None:
            return None
        try:
            fd = os.open(sha, READ_FLAGS, dir_fd=directory)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self._quarantine_path(path, sha, "is a symlink", None)
                return None
            raise pool_error("cannot open object", path, exc) from exc
        finally:
            os.close(directory)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._quarantine_path(path, sha, "is not a regular file", st)
                return None
            data = _read_fd(fd, st.st_size)
            if stamp and time.time() - st.st_mtime > self.stamp_interval:
                # Another user's object may refuse: recency falls back to publish time.
                with contextlib.suppress(OSError):
                    os.utime(fd)
        except OSError as exc:
            raise pool_error("cannot read object", path, exc) from exc
        finally:
            os.close(fd)
        if len(data) != st.st_size or hashlib.sha256(data).hexdigest() != sha:
            self._quarantine_path(path, sha, f"fails verification ({len(data)} bytes)", st)
            return None
        return data

    def _quarantine_path(self, path: str, sha: str, reason: str, st: os.stat_result | None) -> None:
        try:
            now = os.lstat(path)
            if st is not None and (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                return  # already replaced (by a repair); leave the new file alone
            dest = self._quarantine / f"{sha}.{time.time_ns()}.{os.getpid()}.{secrets.token_hex(3)}"
            os.rename(path, dest)
        except FileNotFoundError:
            return  # someone else quarantined it first
        except OSError as exc:
            logger.error("object %s %s but cannot be quarantined: %s", path, reason, exc)
            return
        with self._guard:
            self.quarantined += 1
        logger.warning("object %s %s; moved to %s and treated as a miss", sha, reason, dest)
        pool_maintenance.trim_quarantine(self)

    def objects(self) -> Iterator[str]:
        """The shas present (a directory scan; no hashing).

        Raises:
            PoolError: the objects directory cannot be listed.
        """
        for _path, sha, _st in self._scan():
            yield sha

    def _scan(self) -> Iterator[tuple[str, str, os.stat_result]]:
        try:
            prefixes = sorted(e.name for e in os.scandir(self._objects)
                              if e.is_dir(follow_symlinks=False))
        except OSError as exc:
            raise pool_error("cannot list", self._objects, exc) from exc
        for prefix in prefixes:
            try:
                entries = list(os.scandir(self._objects / prefix))
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

    # -- writing ------------------------------------------------------------------

    def put(self, data: bytes | bytearray | memoryview, sha256: str | None = None) -> str:
        """Store ``data`` and return its sha256. Idempotent: an existing good object
        is kept; a corrupt one is quarantined and replaced.

        Raises:
            IntegrityError: ``sha256`` was given and ``data`` does not match it.
            ValueError: ``sha256`` is malformed.
            PoolError: the object cannot be written.
        """
        actual = hashlib.sha256(data).hexdigest()
        if sha256 is not None and check_sha256(sha256) != actual:
            raise IntegrityError(
                f"refusing to store bytes as {sha256}: their sha256 is {actual}",
                sha256=sha256, actual=actual, source="put",
            )
        if self._read(actual, stamp=True) is not None:
            return actual
        fd, tmp = self._temp_file(actual[:16])
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except OSError as exc:
                raise pool_error("cannot write", tmp, exc) from exc
            self._publish(fd, tmp, actual, len(data))
        finally:
            os.close(fd)
            self._unlink_quietly(tmp)
        return actual

    def _publish(self, fd: int, tmp: str, sha: str, size: int) -> None:
        final = self._object_path(sha)
        try:
            os.fchmod(fd, self._file_mode)
            os.fsync(fd)
            directory = self._objects / sha[:2]
            self._make_dir(directory)
            published = False
            for _attempt in range(2):
                try:
                    os.link(tmp, final)
                    published = True
                except FileExistsError:
                    # First publisher wins. Make sure what won is whole, or repair it.
                    if self._read(sha, stamp=False) is None:
                        continue
                except OSError as exc:
                    if exc.errno not in _NO_LINK:
                        raise
                    os.replace(tmp, final)
                    published = True
                break
        except OSError as exc:
            raise pool_error("cannot publish", final, exc) from exc
        if not published:
            return
        _fsync_dir(str(directory))
        self._journal.append(sha)
        self._account(size)

    def _account(self, size: int) -> None:
        if self.max_bytes is None:
            return
        with self._guard:
            if self._approx_bytes is not None:
                self._approx_bytes += size
            current = self._approx_bytes
        if current is None:
            current = sum(st.st_size for _p, _s, st in self._scan())
            self._set_approx_bytes(current)
        if current > self.max_bytes:
            self.gc()

    def _set_approx_bytes(self, size: int) -> None:
        # An exact measure (a scan or gc()); later publishes count up from there.
        with self._guard:
            self._approx_bytes = size

    def fetch(self, artifact: Artifact, origin: SupportsFetchInto) -> bytes:
        """The verified bytes of ``artifact``: from the pool, else from ``origin``.

        On a miss, one process per pool downloads while the others wait (at most
        ``lock_timeout`` seconds) for its object; if the downloader dies its lock
        dies with it and the next waiter downloads. A lock that times out or does not
        work costs a duplicate download, never a corrupt object or a hang.

        Raises:
            IntegrityError: the origin's bytes do not match the sha256 (or size).
            OriginError: the origin cannot deliver (passed through).
            PoolError: the pool cannot be written.
        """
        sha = artifact.sha256
        data = self._read(sha, stamp=True)
        if data is None:
            lock = FileLock(self._locks / f"{sha}.lock", timeout=self.lock_timeout,
                            remove_on_release=True)
            got = lock.acquire()
            try:
                if not got:
                    logger.warning("waited %.0fs for another download of %s; downloading it too",
                                   self.lock_timeout, artifact.name)
                else:
                    data = self._read(sha, stamp=True)
                if data is None:
                    data = self._download(artifact, origin)
            finally:
                lock.release()
        self._check_size(artifact, len(data), "pool")
        self.remember([artifact])
        return data

    @staticmethod
    def _check_size(artifact: Artifact, size: int, source: str) -> None:
        if artifact.size is not None and size != artifact.size:
            raise IntegrityError(
                f"{artifact.name}: expected {artifact.size} bytes, got {size} from {source}",
                sha256=artifact.sha256, actual=f"{size} bytes", source=source,
            )

    def _download(self, artifact: Artifact, origin: SupportsFetchInto) -> bytes:
        fd, tmp = self._temp_file(artifact.sha256[:16])
        source = origin.describe()
        try:
            try:
                with open(fd, "w+b", closefd=False) as out:
                    origin.fetch_into(artifact, out)
                    out.flush()
                size = os.fstat(fd).st_size
                data = os.pread(fd, size, 0)
            except PoolError:
                raise
            except OSError as exc:
                # The origin streams into our temp file: a full disk or quota shows up
                # as a bare OSError from its write.
                raise pool_error("cannot write", tmp, exc) from exc
            actual = hashlib.sha256(data).hexdigest()
            if actual != artifact.sha256:
                raise IntegrityError(
                    f"sha256 mismatch for {artifact.name} from {source}: expected "
                    f"{artifact.sha256}, got {actual}; check the origin",
                    sha256=artifact.sha256, actual=actual, source=source,
                )
            self._check_size(artifact, len(data), source)
            self._publish(fd, tmp, artifact.sha256, len(data))
            return data
        finally:
            os.close(fd)
            self._unlink_quietly(tmp)

    def materialize(self, artifact: Artifact, into_dir: str | os.PathLike[str]) -> Path:
        """Place the artifact at ``into_dir/<name>`` and return that path.

        A hard link to the object when on the same filesystem, else an atomic copy.
        An existing correct target is kept; a wrong one (or a symlink) is replaced
        atomically, so any number of processes may materialize the same target.

        Raises:
            ArtifactNameError: the name is unsafe (checked before touching any file).
            PoolError: the object is not in the pool, or the target cannot be written.
        """
        into = Path(os.path.abspath(into_dir))
        target = path_under(into, artifact.name)
        sha = check_sha256(artifact.sha256)
        data = self._read(sha, stamp=True)
        if data is None:
            raise PoolError(
                f"cannot materialize {artifact.name}: {sha} is not in the pool at {self.root}; "
                "fetch it first",
                path=self._object_path(sha), errno=errno.ENOENT,
            )
        self._check_size(artifact, len(data), "pool")
        try:
            self._materialize_into(into, target, sha, data)
        except OSError as exc:
            if isinstance(exc, PoolError):
                raise
            raise pool_error("cannot materialize", target, exc) from exc
        self.remember([artifact])
        return target

    def _materialize_into(self, into: Path, target: Path, sha: str, data: bytes) -> None:
        self._ensure_dirs(into, target.parent)
        obj = self._object_path(sha)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            ost = os.lstat(obj)
            if (st.st_ino, st.st_dev) == (ost.st_ino, ost.st_dev):
                return
            if st.st_size == len(data) and self._file_matches(target, sha):
                return
        tmp = os.path.join(target.parent, f".{target.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            try:
                os.link(obj, tmp)
            except OSError as exc:
                if exc.errno != errno.EXDEV and exc.errno not in _NO_LINK:
                    raise
                fd = os.open(tmp, _CREATE, 0o600)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fchmod(fd, self._file_mode)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, target)
        finally:
            self._unlink_quietly(tmp)

    @staticmethod
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

    @staticmethod
    def _file_matches(path: Path, sha: str) -> bool:
        try:
            fd = os.open(path, READ_FLAGS)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            data = _read_fd(fd, st.st_size)
        except OSError:
            return False
        finally:
            os.close(fd)
        return len(data) == st.st_size and hashlib.sha256(data).hexdigest() == sha

    # -- labels and journal -------------------------------------------------------

    def remember(self, artifacts: Iterable[Artifact]) -> None:
        """Record ``name -> sha`` labels (validated first; unchanged ones are skipped).

        Raises:
            ArtifactNameError: a name is unsafe (nothing is written).
            ValueError: a sha256 is malformed.
            PoolError: the index cannot be written.
        """
        self._names_index.record(
            [(validate_name(a.name), check_sha256(a.sha256)) for a in artifacts]
        )

    def names(self) -> dict[str, str]:
        """Every recorded name and the sha it maps to (the last record wins).

        Raises:
            PoolError: the index cannot be read.
        """
        return self._names_index.snapshot()

    def journal_since(self, cursor: int = 0) -> tuple[list[str], int]:
        """Shas published into this pool (by any process) after ``cursor``, oldest
        first and without repeats, and the cursor to pass next time (``0`` starts from
        the beginning).

        Raises:
            PoolError: the journal cannot be read.
        """
        return self._journal.since(cursor)

    # -- maintenance (distcache.pool_maintenance) ----------------------------------

    def gc(self, max_bytes: int | None = None) -> GcReport:
        """Remove least recently used objects until at most ``max_bytes`` remain
        (default: the pool's cap; no cap means nothing is removed). Safe under
        concurrent readers: an open object stays readable; a reader that comes
        later sees a miss.

        Raises:
            PoolError: the objects directory cannot be listed.
        """
        return pool_maintenance.gc(self, max_bytes)

    def verify(self) -> VerifyReport:
        """Hash every object; quarantine the corrupt ones.

        Raises:
            PoolError: the pool cannot be listed or an object cannot be read.
        """
        return pool_maintenance.verify(self)

    def stats(self) -> PoolStats:
        """Counts from a directory scan (no hashing).

        Raises:
            PoolError: the pool cannot be listed.
        """
        return pool_maintenance.stats(self)

    def sweep(self, max_age: float = STALE_TMP_SECONDS) -> int:
        """Remove temporary files untouched for ``max_age`` seconds (left by crashed
        writers; a live download keeps its file's mtime fresh) and lock files nobody
        holds. Runs when the pool is opened. Returns the number of files removed.
        """
        return pool_maintenance.sweep(self, max_age)
