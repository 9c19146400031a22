"""Objects on disk: verified reads, atomic publication, quarantine and scans.

:class:`ObjectStore` is the content-addressed half of a pool: the bytes under
``objects/<sha[:2]>/<sha>`` and nothing about names, origins or size caps. It keeps
the rules of DESIGN.md ("Artifacts and the pool") for each object:

- **Never follow a symlink inside the pool.** Objects are opened relative to an
  ``O_NOFOLLOW`` descriptor of their fan-out directory ``objects/<xx>``, so a symlink
  planted there or as an object is a miss for readers; publishers move it into
  ``quarantine/`` and refuse to write when they cannot: the pool's user never reads
  or writes through it.
- **Every read is verified.** A wrong, truncated or non-file object is moved to
  ``quarantine/``, counted, logged and reported as a miss; corrupt bytes are never
  returned; a file past :data:`LARGE_FILE` is hashed in chunks before it is read
  whole (unless trusted, below), so a huge one is quarantined without filling memory.
  A reader that asks for it (``trusted``) skips the hash of an object this
  store verified in this process (published it with ``link``, hashed as it was
  written; or was vouched for by the job's node leader, which did) while its file is
  unchanged: this user's, with the same device, inode, size, mtime and ctime
  (:func:`~distcache.store._fs.witness`). Writing, renaming, ``utime`` and
  ``chmod`` move a file's ctime, which only root can set: a file put in the object's
  place (a reused inode number, the old mtime) is hashed. A recency stamp (below)
  moves it too: the stamping process keeps trusting it, others hash again.
- **Publish whole files: write, fsync, link, then verify.** ``link(2)`` fails on an
  existing name, so the first publisher wins and a crash leaves no object or a whole
  one. A loser does not trust the winner blindly: it reads (so verifies) what is
  there and, if that was corrupt and moved aside, links again. Where ``link`` is
  refused (some FUSE, SMB) an atomic ``rename`` replaces instead.
- **Durability per batch.** Inside :meth:`ObjectStore.batch` the ``fsync`` of each
  object, its directory and ``objects/`` waits for one flush when the batch ends; a
  torn object is caught by the verified read (:mod:`distcache.store._durability`).

Recency for LRU collection is the object's mtime, refreshed by reads at most once per
``stamp_interval`` seconds (atime is useless on ``noatime`` mounts); a reader that may
not touch another user's object skips the stamp.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import Artifact, sha256_hex
from distcache.errors import IntegrityError
from distcache.store._durability import Durability
from distcache.store._fs import (
    LINKED,
    Witness,
    link_into_place,
    make_fanout,
    move_aside,
    pool_error,
    temp_file,
    trusted_file,
    unlink_quietly,
    withdraw,
    witness,
    write_all,
)
from distcache.store._quarantine import trim_quarantine
from distcache.store._reading import DIR_FLAGS, NotAnObject, open_object, read_object
from distcache.store.layout import PoolLayout, scan_objects

logger = get_logger(__name__)

def check_size(artifact: Artifact, size: int, source: str) -> None:
    """Raise :class:`IntegrityError` unless ``size`` bytes from ``source`` is the
    size ``artifact`` declares (if it declares one)."""
    if artifact.size is not None and size != artifact.size:
        raise IntegrityError(
            f"{artifact.name}: expected {artifact.size} bytes, got {size} from {source}",
            sha256=artifact.sha256, actual=f"{size} bytes", source=source)


class ObjectStore:
    """The objects of the pool laid out by ``layout``: ``host`` (this host's name,
    sanitised) names temporary files, ``file_mode`` is that of published objects
    (``0o444`` less the umask), ``setgid`` whether new fan-out directories get the
    set-gid bit."""

    #: Reads refresh an object's recency stamp when it is older than this (seconds).
    stamp_interval: float = 60.0
    #: Quarantined entries kept for inspection, newest first (:func:`trim_quarantine`).
    quarantine_keep: int = 16

    def __init__(self, layout: PoolLayout, *, host: str, file_mode: int, setgid: bool) -> None:
        self.layout = layout
        self.host = host
        self.file_mode = file_mode
        self.setgid = setgid
        #: Objects this store moved to ``quarantine/``.
        self.quarantined = 0
        self._guard = threading.Lock()
        self._durability = Durability(str(layout.objects))
        #: Objects verified in this process (published here, or vouched for) and
        #: their files' witnesses then: :meth:`read` with ``trusted`` does not hash
        #: them again while the file is unchanged.
        self.fresh: dict[str, Witness] = {}
        #: Objects whose recency stamp this user may not write (another user's).
        self._unstampable: set[str] = set()

    def verified(self) -> dict[str, Witness]:
        """The objects verified in this process, with their witnesses."""
        with self._guard:
            return dict(self.fresh)

    def vouch(self, witnesses: dict[str, Witness]) -> None:
        """Take objects another process of the job verified (while their files match)."""
        with self._guard:
            self.fresh.update(witnesses)

    def batch(self, *, wait: bool = True) -> contextlib.AbstractContextManager[None]:
        """Defer the durability of publications until the outermost batch ends, then
        flush them together (:meth:`Durability.batch`, whose flush may raise
        :class:`PoolError`)."""
        return self._durability.batch(wait=wait)

    def has(self, sha: str) -> bool:
        """Whether a regular file is present for ``sha`` (no hashing)."""
        try:
            return stat.S_ISDIR(os.lstat(self.layout.fanout(sha)).st_mode) and (
                stat.S_ISREG(os.lstat(self.layout.object_path(sha)).st_mode))
        except OSError:
            return False

    def holding(self, shas: Iterable[str]) -> list[bool]:
        """:meth:`has` for each of ``shas``. A fanout directory asked about a few
        objects is checked once and each object with one ``lstat``; one asked about
        many (a whole family) is listed once, through a descriptor that does not
        follow a link, and its regular files are read off the listing."""
        wanted = list(shas)
        by_fanout: dict[str, list[int]] = {}
        for i, sha in enumerate(wanted):
            by_fanout.setdefault(sha[:2], []).append(i)
        found = [False] * len(wanted)
        for indices in by_fanout.values():
            fanout = self.layout.fanout(wanted[indices[0]])
            if len(indices) >= _LISTED:
                try:
                    files = _regular_files(fanout, {wanted[i] for i in indices})
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        continue  # absent, or not a real directory: holds none of them
                    # Not listable (search permission only, an I/O error): as has().
                else:
                    for i in indices:
                        found[i] = wanted[i] in files
                    continue
            try:
                if not stat.S_ISDIR(os.lstat(fanout).st_mode):
                    continue
            except OSError:
                continue
            for i in indices:
                with contextlib.suppress(OSError):
                    found[i] = stat.S_ISREG(os.lstat(self.layout.object_path(wanted[i])).st_mode)
        return found

    def stamp(self, sha: str, *, write: bool = True) -> int | None:
        """The size of the object ``sha`` when a regular file is there (None: absent,
        or not a file); with ``write``, its recency stamp is refreshed when older than
        :attr:`stamp_interval`, as a read does: a job that holds it uses it now.

        One ``lstat`` when the stamp is recent (a start-up holds every object it
        found); a stale one is stamped through a descriptor opened as a read opens it
        (no link followed), and only that file's times are taken for the object's. A
        stamp this user may not write (another user's object) is skipped, and not
        tried again by this store."""
        path = self.layout.object_path(sha)
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        if not write or sha in self._unstampable or (
                time.time() - st.st_mtime <= self.stamp_interval):
            return st.st_size
        try:
            opened = open_object(self.layout.fanout(sha), sha, path)
        except (NotAnObject, OSError):  # PoolError: it cannot be opened
            return None
        if opened is None:
            return None
        fd, st = opened
        try:
            os.utime(fd)
            now = os.fstat(fd)
        except OSError:  # recency falls back to publish time
            with self._guard:
                if len(self._unstampable) < 100_000:
                    self._unstampable.add(sha)
        else:
            self._restamped(sha, st, now)
        finally:
            os.close(fd)
        return st.st_size

    def _restamped(self, sha: str, before: os.stat_result, after: os.stat_result) -> None:
        """A recency stamp moved the times of the file ``before`` described: when that
        file was the one verified, ``after`` is what is verified now."""
        with self._guard:
            if trusted_file(before, self.fresh.get(sha)):
                self.fresh[sha] = witness(after)

    def read(self, sha: str, *, stamp: bool, trusted: bool = False) -> bytes | None:
        """The verified bytes of ``sha``, or None when absent or corrupt (then
        quarantined); ``stamp`` refreshes its recency. With ``trusted``, an object
        verified in this process whose file is unchanged since (:attr:`fresh`) is
        returned without hashing it again (unless it changed while it was read).
        :class:`PoolError` when the object exists but cannot be read."""
        try:
            found = read_object(self.layout.fanout(sha), sha, self.layout.object_path(sha),
                                self.stamp_interval if stamp else None,
                                self.fresh.get(sha) if trusted else None)
        except NotAnObject as bad:
            self.quarantine(sha, bad.reason, bad.st)
            return None
        if found is None:
            return None
        data, st, unchanged, stamped = found
        if (trusted and unchanged and len(data) == st.st_size
                and trusted_file(st, self.fresh.get(sha))):
            if stamped is not None:
                self._restamped(sha, st, stamped)
            return data
        if len(data) != st.st_size or sha256_hex(data) != sha:
            self.quarantine(sha, f"fails verification ({len(data)} bytes)", st)
            return None
        return data

    def quarantine(self, sha: str, reason: str, st: os.stat_result | None,
                   path: str | None = None) -> None:
        """Move ``path`` (default: the object ``sha``), found bad for ``reason``, into
        ``quarantine/``; ``st`` given, only while it is still that inode."""
        path = self.layout.object_path(sha) if path is None else path
        dest = self.layout.quarantine_path(sha)
        try:
            moved = move_aside(path, dest, st)
        except OSError as exc:
            logger.error("%s %s but cannot be quarantined: %s", path, reason, exc)
            return
        if not moved:
            return  # someone else quarantined it first, or a repair already replaced it
        with self._guard:
            self.quarantined += 1
            self.fresh.pop(sha, None)
        logger.warning("%s %s; moved to %s and treated as a miss", path, reason, dest)
        trim_quarantine(self.layout, self.quarantine_keep)

    def scan(self, unlisted: list[tuple[str, OSError]] | None = None
             ) -> Iterator[tuple[str, str, os.stat_result]]:
        """``(path, sha, lstat)`` of each object present (no hashing); :class:`PoolError`
        when the objects directory cannot be listed (``unlisted``: :func:`scan_objects`)."""
        return scan_objects(self.layout, unlisted)

    @contextlib.contextmanager
    def staged(self, tag: str) -> Iterator[tuple[int, str]]:
        """A new exclusive temporary file in ``tmp/`` (fd, path) for :meth:`publish`:
        closed when the block ends, removed if it raises (:class:`PoolError` if it
        cannot be created)."""
        tmp = self.layout.temp_path(tag, self.host)
        fd = temp_file(tmp)
        try:
            yield fd, tmp
        except BaseException:
            unlink_quietly(tmp)
            raise
        finally:
            os.close(fd)

    def write(self, data: bytes | bytearray | memoryview, sha: str) -> bool:
        """Publish ``data``, already known to hash to ``sha``; whether this call
        published it (False: a good object was there first); :class:`PoolError` when
        it cannot be written."""
        with self.staged(sha[:16]) as (fd, tmp):
            try:
                write_all(fd, data)
            except OSError as exc:
                raise pool_error("cannot write", tmp, exc) from exc
            return self.publish(fd, tmp, sha)

    def publish(self, fd: int, tmp: str, sha: str) -> bool:
        """Make the whole, verified temporary file ``tmp`` (open as ``fd``) the object
        ``sha``; whether this call published it. ``tmp`` is gone when it returns
        (linked and removed, renamed, or removed: a good object was there first).
        :class:`PoolError` when it cannot be published."""
        final = self.layout.object_path(sha)
        directory = self.layout.fanout(sha)
        deferred = self._durability.deferred
        try:
            os.fchmod(fd, self.file_mode)
            if not deferred:
                os.fsync(fd)
            size = os.fstat(fd).st_size if deferred else 0
            made = not self._clear_fanout(directory, sha) and make_fanout(
                Path(directory), setgid=self.setgid, flush=not deferred)
            # First publisher wins; a loser makes sure what won is whole, or repairs it.
            published = link_into_place(
                tmp, final, lambda: self.read(sha, stamp=False) is not None)
            if published == LINKED:
                # The temporary name goes first: its removal moves the file's ctime.
                unlink_quietly(tmp)
                seen: Witness | None = witness(os.fstat(fd))
            else:  # a rename where links are refused (FUSE, SMB): inodes may be made up
                seen = None
        except OSError as exc:
            raise pool_error("cannot publish", final, exc) from exc
        if published is None:
            unlink_quietly(tmp)
            return False
        try:
            self._durability.settle(final, size, deferred=deferred, made=made)
        except BaseException:
            withdraw(final, fd)  # a failed publication publishes nothing
            raise
        if seen is not None:
            with self._guard:
                self.fresh[sha] = seen
        return True

    def _clear_fanout(self, directory: str, sha: str) -> bool:
        """Whether ``objects/<xx>`` is a real directory already (nothing to make);
        else move what is there instead (a planted symlink, a stray file) into
        quarantine, so that publishing heals the pool instead of failing for ever. If
        it cannot be moved, :func:`make_fanout` refuses to publish."""
        try:
            st = os.lstat(directory)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            return True
        self.quarantine(sha, "is not a directory (a planted symlink?)", st, path=directory)
        return False


#: Objects asked about in one fanout directory from which :meth:`ObjectStore.holding`
#: lists the directory instead of checking each object.
_LISTED = 16


def _regular_files(fanout: str, names: set[str]) -> set[str]:
    """Those of ``names`` that are regular files in ``fanout``, listed through a
    descriptor opened without following a link (``OSError`` when it is absent, not a
    real directory or cannot be listed). Only the names asked about are typed, so a
    filesystem without entry types costs an ``fstatat`` for each of them alone."""
    fd = os.open(fanout, DIR_FLAGS)
    try:
        with os.scandir(fd) as entries:
            return {e.name for e in entries if e.name in names
                    and e.is_file(follow_symlinks=False)}
    finally:
        os.close(fd)
