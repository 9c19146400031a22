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

Recency for LRU collection is the object's mtime, refreshed by reads at most once
per ``stamp_interval`` seconds (atime is useless on ``noatime`` mounts); a reader
that may not touch another user's object simply skips the stamp.

How files are opened, created, published and moved (never through a symlink,
process-unique ``O_EXCL`` temporary files, link-then-verify, set-gid shared pools)
is the filesystem layer in :mod:`distcache.store._fs`. The two logs live in
:mod:`distcache.store._log` and the whole-pool maintenance (``gc``, ``verify``,
``stats``, ``sweep``) in :mod:`distcache.store._maintenance`;
:class:`ArtifactPool` is the one public entry point to all of it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from distcache.artifact import Artifact, check_sha256, path_under, sha256_hex, validate_name
from distcache.config import settings
from distcache.errors import ConfigError, IntegrityError, PoolError
from distcache.store import _fs as pool_fs
from distcache.store import _maintenance as pool_maintenance
from distcache.store._fs import pool_error
from distcache.store._locking import FileLock
from distcache.store._log import Journal, NamesIndex
from distcache.store._maintenance import STALE_TMP_SECONDS
from distcache.store._report import GcReport, PoolStats, VerifyReport

__all__ = ["ArtifactPool", "GcReport", "PoolStats", "SupportsFetchInto", "VerifyReport"]

logger = logging.getLogger(__name__)


class SupportsFetchInto(Protocol):
    """The part of the Origin protocol the pool uses."""

    def describe(self) -> str: ...

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int: ...


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
        self.lock_timeout: float = resolved.lock_timeout
        self.root = Path(os.path.abspath(root))
        self.quarantined = 0
        umask = pool_fs.process_umask()
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
            pool_fs.make_dir(directory, setgid=self._setgid)
        self._objects_prefix = f"{self._objects}{os.sep}"
        self._names_index = NamesIndex(self.root / "names.log", 0o666)
        self._journal = Journal(self.root / "journal.log", 0o666)
        self.pool_id = pool_fs.load_pool_id(self.root / "pool_id", tmp_dir=self._tmp,
                                            host=self._host, mode=self._file_mode)
        self.sweep()

    def __repr__(self) -> str:
        return f"ArtifactPool({str(self.root)!r}, pool_id={self.pool_id!r})"

    def _object_path(self, sha: str) -> str:
        return f"{self._objects_prefix}{sha[:2]}{os.sep}{sha}"

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
        try:
            found = pool_fs.read_object(f"{self._objects_prefix}{sha[:2]}", sha,
                                        self.stamp_interval if stamp else None)
        except pool_fs.NotAnObject as bad:
            self._quarantine_object(sha, bad.reason, bad.st)
            return None
        if found is None:
            return None
        data, st = found
        if len(data) != st.st_size or sha256_hex(data) != sha:
            self._quarantine_object(sha, f"fails verification ({len(data)} bytes)", st)
            return None
        return data

    def _quarantine_object(self, sha: str, reason: str, st: os.stat_result | None,
                           path: str | None = None) -> None:
        """Move ``path`` (default: the object ``sha``) into ``quarantine/``."""
        path = self._object_path(sha) if path is None else path
        try:
            # None: someone else quarantined it first, or a repair already replaced it.
            dest = pool_fs.move_aside(path, self._quarantine, sha, st)
        except OSError as exc:
            logger.error("%s %s but cannot be quarantined: %s", path, reason, exc)
            return
        if dest is None:
            return
        with self._guard:
            self.quarantined += 1
        logger.warning("%s %s; moved to %s and treated as a miss", path, reason, dest)
        pool_maintenance.trim_quarantine(self)

    def objects(self) -> Iterator[str]:
        """The shas present (a directory scan; no hashing).

        Raises:
            PoolError: the objects directory cannot be listed.
        """
        for _path, sha, _st in self._scan():
            yield sha

    def _scan(self) -> Iterator[tuple[str, str, os.stat_result]]:
        return pool_fs.scan_objects(self._objects)

    # -- writing ------------------------------------------------------------------

    def put(self, data: bytes | bytearray | memoryview, sha256: str | None = None) -> str:
        """Store ``data`` and return its sha256. Idempotent: an existing good object
        is kept; a corrupt one is quarantined and replaced.

        Raises:
            IntegrityError: ``sha256`` was given and ``data`` does not match it.
            ValueError: ``sha256`` is malformed.
            PoolError: the object cannot be written.
        """
        actual = sha256_hex(data)
        if sha256 is not None and check_sha256(sha256) != actual:
            raise IntegrityError(
                f"refusing to store bytes as {sha256}: their sha256 is {actual}",
                sha256=sha256, actual=actual, source="put",
            )
        if self._read(actual, stamp=True) is not None:
            return actual
        fd, tmp = pool_fs.temp_file(self._tmp, actual[:16], self._host)
        try:
            try:
                pool_fs.write_all(fd, data)
            except OSError as exc:
                raise pool_error("cannot write", tmp, exc) from exc
            self._publish(fd, tmp, actual, len(data))
        finally:
            os.close(fd)
            pool_fs.unlink_quietly(tmp)
        return actual

    def _publish(self, fd: int, tmp: str, sha: str, size: int) -> None:
        final = self._object_path(sha)
        try:
            os.fchmod(fd, self._file_mode)
            os.fsync(fd)
            directory = self._objects / sha[:2]
            self._clear_fanout(directory, sha)
            pool_fs.make_dir(directory, setgid=self._setgid)
            # First publisher wins; a loser makes sure what won is whole, or repairs it.
            published = pool_fs.link_into_place(
                tmp, final, lambda: self._read(sha, stamp=False) is not None)
        except OSError as exc:
            raise pool_error("cannot publish", final, exc) from exc
        if not published:
            return
        pool_fs.fsync_dir(directory)
        self._journal.append(sha)
        self._account(size)

    def _clear_fanout(self, directory: Path, sha: str) -> None:
        """Move a non-directory (a planted symlink, a stray file) at ``objects/<xx>``
        into quarantine, so that publishing heals the pool instead of failing for
        ever. If it cannot be moved, :func:`pool_fs.make_dir` refuses to publish."""
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            self._quarantine_object(sha, "is not a directory (a planted symlink?)", st,
                                    path=str(directory))

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
        fd, tmp = pool_fs.temp_file(self._tmp, artifact.sha256[:16], self._host)
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
            actual = sha256_hex(data)
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
            pool_fs.unlink_quietly(tmp)

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
            pool_fs.materialize_file(self._object_path(sha), into, target, sha, data,
                                     self._file_mode)
        except OSError as exc:
            if isinstance(exc, PoolError):
                raise
            raise pool_error("cannot materialize", target, exc) from exc
        self.remember([artifact])
        return target

    # -- labels and journal -------------------------------------------------------

    def remember(self, artifacts: Iterable[Artifact]) -> None:
        """Record ``name -> sha`` labels (validated first; unchanged ones are skipped).

        Raises:
            ArtifactNameError: a name is unsafe (nothing is written).
            ValueError: a sha256 is malformed.
            PoolError: the index cannot be written.
        """
        pairs = [(a.name, a.sha256) for a in artifacts]
        # fetch() and materialize() remember on every hit, and a hit must stay a few
        # syscalls: labels this process already holds cost neither I/O nor validation
        # (every held name was validated when it was recorded or read back).
        if self._names_index.holds(pairs):
            return
        self._names_index.record([(validate_name(n), check_sha256(s)) for n, s in pairs])

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

    # -- maintenance (distcache.store._maintenance) ----------------------------------

    def gc(self, max_bytes: int | None = None) -> GcReport:
        """Remove least recently used objects until at most ``max_bytes`` (default:
        the pool's cap) remain; see :func:`distcache.store._maintenance.gc`."""
        return pool_maintenance.gc(self, max_bytes)

    def verify(self) -> VerifyReport:
        """Hash every object; quarantine the corrupt ones
        (:func:`distcache.store._maintenance.verify`)."""
        return pool_maintenance.verify(self)

    def stats(self) -> PoolStats:
        """Counts from a directory scan, no hashing
        (:func:`distcache.store._maintenance.stats`)."""
        return pool_maintenance.stats(self)

    def sweep(self, max_age: float = STALE_TMP_SECONDS) -> int:
        """Remove stale temporary and lock files, as on every open; how many
        (:func:`distcache.store._maintenance.sweep`)."""
        return pool_maintenance.sweep(self, max_age)
