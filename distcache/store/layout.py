"""Where each file of a pool lives, and which on-disk format the pool is in.

A pool root holds::

    format                      the format version (a decimal integer), written once
    pool_id                     stable identity, written atomically at creation and
                                replaced once when the pool is found to be a copy
    objects/<sha[:2]>/<sha>     the bytes, read-only (0444 less the umask)
    tmp/                        process-unique temporary files; stale ones are swept
    tmp/probe.<name>            a collective's proof that ranks see this directory,
                                named for one run, removed when the check ends
    quarantine/<sha>.<ns>.<pid>.<hex>
                                objects that failed verification, kept for inspection
    locks/<sha>.lock            per-object download locks (kernel-released; economy only)
    locks/pool_id.lock          held while a copied pool takes a fresh ``pool_id``
    names.log                   append-only "name -> sha" labels, last entry wins
    journal.log                 append-only list of shas published into this pool
    sync.cursor                 where the last collective sync over a set of pools left
                                journal.log ("<pools key> <byte offset> <crc32 of the
                                bytes before it> <token>" lines, the token that sync's,
                                alike in every pool it reached), so the next one over
                                the same pools sends only what follows
    sync.names.cursor           the same for names.log ("<pools key> <byte offset>
                                <crc32 of every byte before it>" lines), so the labels
                                recorded since reach the other pools too
    locks/sync*.cursor.lock     held while a cursor file is rewritten

:class:`PoolLayout` is the one place that names these paths; the rest of
:mod:`distcache.store` asks it rather than joining paths itself, so a change of layout
is a change of this module (and of :data:`FORMAT_VERSION`).

Format versions. :data:`FORMAT_VERSION` is the format this code reads and writes. A
new pool records it in ``format`` before anything else exists. A pool made before
that file existed (``objects/`` or ``pool_id`` present, no ``format``) is format 1,
the same layout: opening it records ``1`` atomically and changes nothing else. A
pool of an older format is brought up to date by the steps in ``_MIGRATIONS``, then
its ``format`` is replaced atomically; a pool of a newer format is refused with a
:class:`~distcache.errors.PoolError` rather than read with the wrong rules.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from distcache._log import get_logger
from distcache._record import Record
from distcache.errors import PoolError
from distcache.store._fs import (
    create_once,
    fsync_dir,
    is_sha,
    make_dir,
    pool_error,
    read_small_file,
    temp_file,
    unlink_quietly,
    write_all,
)

__all__ = ["FORMAT_VERSION", "PoolLayout"]

logger = get_logger(__name__)

#: The on-disk format this version of distcache reads and writes.
FORMAT_VERSION = 1

#: Temporary and lock files untouched this long (seconds) are taken as abandoned.
STALE_TMP_SECONDS = 3600.0

#: Steps that bring a pool of format ``n`` to format ``n + 1`` (none yet: format 1
#: is the first). A step must be idempotent, since two processes may open an old pool
#: at the same time and both run it.
_MIGRATIONS: dict[int, Callable[[PoolLayout], None]] = {}

# Errors that keep a process from recording the format of a pool it may still read
# (another user's pool, a read-only mount); the layout is the same, so reading goes on.
_READ_ONLY = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def _token(nbytes: int) -> str:
    """A random hex token of ``nbytes`` bytes (``secrets.token_hex`` without importing
    ``random``, which ``secrets`` does)."""
    return os.urandom(nbytes).hex()


class PoolLayout(Record):
    """Every on-disk path of the pool at ``root`` (made absolute).

    Building one touches no file; :meth:`open_format` is the one method that does.
    """

    _FIELDS = ("root",)
    __slots__ = (*_FIELDS, "format_file", "pool_id_file", "objects", "tmp", "quarantine",
                 "locks", "names_log", "journal_log", "sync_cursor", "sync_names_cursor",
                 "_objects_prefix")
    #: The pool directory.
    root: Path
    #: ``format``: the on-disk format version.
    format_file: Path
    #: ``pool_id``: the pool's stable identity.
    pool_id_file: Path
    #: ``objects/``: the content-addressed bytes, fanned out by the sha's first two digits.
    objects: Path
    #: ``tmp/``: temporary files of writes in progress.
    tmp: Path
    #: ``quarantine/``: objects that failed verification.
    quarantine: Path
    #: ``locks/``: per-object download locks.
    locks: Path
    #: ``names.log``: the name -> sha labels.
    names_log: Path
    #: ``journal.log``: the shas published into the pool.
    journal_log: Path
    #: ``sync.cursor``: the journal offsets the last collective syncs reached.
    sync_cursor: Path
    #: ``sync.names.cursor``: the ``names.log`` offsets the last collective syncs reached.
    sync_names_cursor: Path
    # Object paths are built on every read: one string concatenation, no Path objects.
    _objects_prefix: str

    def __init__(self, root: str | os.PathLike[str]) -> None:
        base = Path(os.path.abspath(root))
        paths = {"root": base, "format_file": base / "format", "pool_id_file": base / "pool_id",
                 "objects": base / "objects", "tmp": base / "tmp",
                 "quarantine": base / "quarantine", "locks": base / "locks",
                 "names_log": base / "names.log", "journal_log": base / "journal.log",
                 "sync_cursor": base / "sync.cursor",
                 "sync_names_cursor": base / "sync.names.cursor",
                 "_objects_prefix": f"{base / 'objects'}{os.sep}"}
        for name, value in paths.items():
            self._set(name, value)

    @property
    def directories(self) -> tuple[Path, ...]:
        """The directories a pool needs, in the order they are created."""
        return (self.objects, self.tmp, self.quarantine, self.locks)

    def is_pool(self, *, made_by_distcache: bool = False) -> bool:
        """Whether ``root`` already holds a pool: its ``objects/`` is a directory.

        With ``made_by_distcache``, also the ``format`` or ``pool_id`` file that every
        pool distcache made has (a pool older than ``format`` has ``pool_id``): another
        tool's directory with an ``objects/`` (a git directory) is then not a pool.

        Raises:
            PoolError: this user cannot look into ``root`` (a directory on the way it may
                not enter).
        """
        try:
            if not self.objects.is_dir():
                return False
            return (not made_by_distcache or self.format_file.is_file()
                    or self.pool_id_file.is_file())
        except OSError as exc:  # a directory on the way this user may not enter
            raise PoolError(
                f"cannot look into the pool {self.root}: {exc.strerror or exc}; this user "
                "must be able to enter it and its objects/ directory: check their "
                "permissions and owner", path=str(self.root), errno=exc.errno) from exc

    @staticmethod
    def fanout_name(sha: str) -> str:
        """The name of the ``objects/`` subdirectory that holds ``sha``."""
        return sha[:2]

    def fanout(self, sha: str) -> str:
        """``objects/<sha[:2]>``, the directory that holds ``sha``."""
        return f"{self._objects_prefix}{sha[:2]}"

    def object_path(self, sha: str) -> str:
        """``objects/<sha[:2]>/<sha>``, where the object ``sha`` lives."""
        return f"{self._objects_prefix}{sha[:2]}{os.sep}{sha}"

    def lock_path(self, sha: str) -> Path:
        """``locks/<sha>.lock``, the download lock of ``sha``."""
        return self.locks / f"{sha}.lock"

    def id_lock_path(self) -> Path:
        """``locks/pool_id.lock``, held while ``pool_id`` is replaced."""
        return self.locks / "pool_id.lock"

    def probe_path(self, name: str) -> str:
        """``tmp/probe.<name>``, where a collective places the probe ``name`` (a
        stale one is swept with the other temporary files)."""
        return f"{self.tmp}{os.sep}probe.{name}"

    def temp_path(self, tag: str, host: str) -> str:
        """A fresh, process-unique name in ``tmp/`` (``tag``, ``host``, pid and random
        bits), for a file to be created exclusively and renamed or linked away."""
        return f"{self.tmp}{os.sep}{tag}.{host}.{os.getpid()}.{_token(6)}.tmp"

    def quarantine_path(self, sha: str) -> Path:
        """A new, unique name in ``quarantine/`` for a bad object ``sha``; the time
        in it orders quarantined files (:meth:`quarantined_at`)."""
        return self.quarantine / f"{sha}.{time.time_ns()}.{os.getpid()}.{_token(3)}"

    @staticmethod
    def quarantined_at(name: str) -> int | None:
        """When (ns since the epoch) the quarantine entry ``name`` was made, or None
        for a name :meth:`quarantine_path` does not make."""
        parts = name.split(".")
        if len(parts) == 4 and is_sha(parts[0]) and parts[1].isascii() and parts[1].isdigit():
            return int(parts[1])
        return None

    # -- format version -----------------------------------------------------------

    def read_format(self) -> int | None:
        """The format version recorded in ``format``, or None when there is none.

        Raises:
            PoolError: the file cannot be read or does not hold a positive integer.
        """
        text = read_small_file(self.format_file, "pool format version")
        return None if text is None else self._parse_format(text)

    def _parse_format(self, text: str) -> int:
        if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < 1:
            raise PoolError(
                f"{self.format_file} holds {text[:40]!r}, not a pool format version (a "
                "positive integer): the file is damaged or the directory is not a "
                "distcache pool; restore the file, or point DISTCACHE_POOL at another "
                "directory",
                path=str(self.format_file),
            )
        return int(text)

    def open_format(self, *, host: str, mode: int, setgid: bool) -> int:
        """The pool's format version, recorded first when absent (:data:`FORMAT_VERSION`
        for a new pool, 1 for a pool made before versions were recorded) and brought
        up to :data:`FORMAT_VERSION` when older. ``host`` tags temporary files,
        ``mode`` is the file's permissions, ``setgid`` whether ``tmp/`` inherits
        the root's group.

        Raises:
            PoolError: the version is newer than this code supports, the file is
                malformed, an older format has no migration, or the file cannot be
                read or written.
        """
        found = self.read_format()
        if found is None:
            found = self._record_first_format(host=host, mode=mode, setgid=setgid)
        if found > FORMAT_VERSION:
            raise self._newer(found)
        if found < FORMAT_VERSION:
            self._migrate(found, host=host, mode=mode)
        return FORMAT_VERSION

    def read_only_format(self, text: str | None) -> int:
        """The format version of the existing pool whose ``format`` file holds ``text``,
        for an open that writes nothing: no version is recorded, none migrated. ``None``
        (no file, or one still being created) is format 1, as for a pool made before
        versions were recorded.

        Raises:
            PoolError: ``text`` is not a version, or the version is not
                :data:`FORMAT_VERSION` (a newer one needs a newer distcache; an older
                one is migrated by the first command that writes to the pool).
        """
        found = 1 if text is None else self._parse_format(text)
        if found > FORMAT_VERSION:
            raise self._newer(found)
        if found < FORMAT_VERSION:
            raise PoolError(
                f"the pool at {self.root} has on-disk format {found}, older than format "
                f"{FORMAT_VERSION}, and is not migrated by a command that only reads; "
                "run one that writes to it first (distcache pool verify, say)",
                path=str(self.format_file),
            )
        return found

    def _newer(self, found: int) -> PoolError:
        return PoolError(
            f"the pool at {self.root} has on-disk format {found}, newer than format "
            f"{FORMAT_VERSION}, the newest this version of distcache supports; "
            "upgrade distcache, or point DISTCACHE_POOL at another directory",
            path=str(self.format_file),
        )

    def _record_first_format(self, *, host: str, mode: int, setgid: bool) -> int:
        legacy = os.path.lexists(self.objects) or os.path.lexists(self.pool_id_file)
        version = 1 if legacy else FORMAT_VERSION
        try:
            make_dir(self.tmp, setgid=setgid)
            created = create_once(self.format_file, f"{version}\n".encode("ascii"),
                                  tmp=self.temp_path(self.format_file.name, host), mode=mode,
                                  what="pool format version")
        except PoolError as exc:
            if not (legacy and exc.errno in _READ_ONLY):
                raise
            logger.warning("cannot record format 1 of the pool at %s (%s); reading it as "
                           "format 1", self.root, exc)
            return 1
        if created and legacy:
            logger.info("the pool at %s predates format versions: recorded it as format 1 "
                        "(its layout is unchanged)", self.root)
        recorded = self.read_format()
        if recorded is None:
            raise PoolError(f"{self.format_file} vanished while it was being created; "
                            "open the pool again", path=str(self.format_file))
        return recorded

    def _migrate(self, found: int, *, host: str, mode: int) -> None:
        for version in range(found, FORMAT_VERSION):
            step = _MIGRATIONS.get(version)
            if step is None:
                raise PoolError(
                    f"the pool at {self.root} has on-disk format {found}, which this "
                    f"version of distcache (format {FORMAT_VERSION}) cannot migrate; "
                    "remove the pool to start afresh, or point DISTCACHE_POOL at "
                    "another directory",
                    path=str(self.format_file),
                )
            step(self)
        self._replace_format(FORMAT_VERSION, host=host, mode=mode)
        logger.info("migrated the pool at %s from format %d to format %d", self.root, found,
                    FORMAT_VERSION)

    def _replace_format(self, version: int, *, host: str, mode: int) -> None:
        tmp = self.temp_path(self.format_file.name, host)
        fd = temp_file(tmp)
        try:
            write_all(fd, f"{version}\n".encode("ascii"))
            os.fchmod(fd, mode)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, self.format_file)
            fsync_dir(self.root)
        except OSError as exc:
            raise pool_error("cannot record the pool format version in", self.format_file,
                             exc) from exc
        finally:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
            unlink_quietly(tmp)


def scan_objects(layout: PoolLayout, unlisted: list[tuple[str, OSError]] | None = None
                 ) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(path, sha, lstat)`` of each regular file in ``objects/<xx>/`` named for a
    sha that belongs there; :class:`PoolError` when ``objects`` cannot be listed. A
    fan-out directory this user cannot list (another user's, made under umask 077) is
    passed over as if empty, and added to ``unlisted`` with why when one is given."""
    objects = layout.objects
    try:
        prefixes = sorted(e.name for e in os.scandir(objects) if e.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise pool_error("cannot list", objects, exc) from exc
    for prefix in prefixes:
        try:
            entries = list(os.scandir(objects / prefix))
        except FileNotFoundError:
            continue  # removed meanwhile: it held nothing
        except OSError as exc:
            if unlisted is not None:
                unlisted.append((str(objects / prefix), exc))
            continue
        for entry in entries:
            if not (is_sha(entry.name) and layout.fanout_name(entry.name) == prefix):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield entry.path, entry.name, st

