"""Opening a pool: to write (the root, the format, the layout's directories made as
needed) or to read only (``ArtifactPool(root, read_only=True)``: an existing pool of
the current format, and nothing written there, not even a stale file swept).

A pool open read-only reads its objects without refreshing their recency stamps and
leaves a corrupt one in place (a miss, logged); every write through it raises
:class:`~distcache.errors.PoolError` (:func:`refusal`).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from distcache._log import get_logger
from distcache.errors import PoolError
from distcache.store._fs import READ_FLAGS, fsync_dir, is_hex, make_dir, pool_error, process_umask
from distcache.store._identity import PoolIdentity
from distcache.store._objects import ObjectStore
from distcache.store.layout import PoolLayout

logger = get_logger(__name__)


class Opened(NamedTuple):
    """What opening a pool found: the tag of this host's temporary files, the mode of
    the files it writes, whether the root passes its group on, the format version,
    and whether it was opened read-only."""

    host: str
    file_mode: int
    setgid: bool
    format_version: int
    read_only: bool

    def store(self, layout: PoolLayout) -> ObjectStore:
        """The pool's objects, as this open lets them be read and written."""
        kind = ReadOnlyStore if self.read_only else ObjectStore
        return kind(layout, host=self.host, file_mode=self.file_mode, setgid=self.setgid)

    def identity(self, layout: PoolLayout) -> PoolIdentity:
        """The pool's identity (read, or with a writable open created when absent)."""
        kind = ReadOnlyIdentity if self.read_only else PoolIdentity
        return kind(layout, host=self.host, mode=self.file_mode)


def open_root(layout: PoolLayout, *, read_only: bool) -> Opened:
    """Open the pool at ``layout``: to write (its root, format and directories made or
    migrated as needed), or with ``read_only`` an existing one, writing nothing.

    Raises:
        PoolError: the root or its layout cannot be created or is not a directory; the
            format is newer than this code supports, malformed, or (``read_only``) not
            the current one; (``read_only``) there is no pool at the root.
    """
    file_mode = 0o444 & ~process_umask()
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in os.uname().nodename)
    root = layout.root
    if read_only:
        if not layout.is_pool():
            raise PoolError(f"no pool at {root} (no objects/ directory) to open read-only",
                            path=str(root))
        version = layout.read_only_format(peek(layout.format_file, "pool format version"))
        try:
            setgid = bool(os.stat(root).st_mode & stat.S_ISGID)
        except OSError as exc:
            raise pool_error("cannot open the pool", root, exc) from exc
        return Opened(host, file_mode, setgid, version, read_only=True)
    try:
        root.mkdir(parents=True, exist_ok=True)
        setgid = bool(os.stat(root).st_mode & stat.S_ISGID)
    except FileExistsError as exc:  # what is there is no directory, nor leads to one
        raise PoolError(f"cannot create pool root {root}: {_what_is_at(root)} is there, not "
                        "a directory; point DISTCACHE_POOL (or --pool) at a directory",
                        path=str(root), errno=exc.errno) from exc
    except OSError as exc:
        raise pool_error("cannot create pool root", root, exc) from exc
    if not layout.is_pool():
        _check_new_root(layout)
    else:
        refuse_foreign(layout)
    version = layout.open_format(host=host, mode=file_mode, setgid=setgid)
    # A directory made here is flushed into the root once, so that objects/ (and
    # every object later journaled under it) survives a power loss.
    made = [make_dir(directory, setgid=setgid) for directory in layout.directories]
    if any(made):
        fsync_dir(root)
    return Opened(host, file_mode, setgid, version, read_only=False)


def _what_is_at(path: Path) -> str:
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            target = os.readlink(path)
            return (f"a symbolic link to {target}, which "
                    + ("is no directory" if os.path.lexists(path.parent / target)
                       else "does not exist"))
    except OSError as exc:
        return f"something this user cannot look at ({exc.strerror or exc})"
    kinds = ((stat.S_ISREG, "a file"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
             (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"))
    return next((said for test, said in kinds if test(mode)), "something else")


def refuse_foreign(layout: PoolLayout) -> None:
    """Refuse a directory that has ``objects/`` but neither ``format`` nor ``pool_id``,
    which every pool distcache made has: another tool's (a ``.git`` directory), which
    opening it as a pool would write its format and identity into.

    Raises:
        PoolError: ``layout.root`` is such a directory (nothing is changed there).
    """
    if not layout.is_pool(made_by_distcache=True):
        raise PoolError(
            f"{layout.root} is not a distcache pool: it has objects/ but no format or "
            "pool_id file (another tool's directory?); nothing was changed there: pass "
            "--pool DIR or set DISTCACHE_POOL", path=str(layout.root))


#: Entries a directory may hold before it becomes a pool, beside the pool's own (a
#: creator stopped part-way leaves some): a file system's and hidden ones.
_BESIDE_A_NEW_POOL = ("lost+found",)


def _check_new_root(layout: PoolLayout) -> None:
    """Refuse to make a pool of a directory that holds what is not a pool's (a project
    directory given as the pool): every open sweeps ``tmp/`` and ``locks/``, and would
    delete what the directory's owner keeps there.

    Raises:
        PoolError: naming the root and what it holds.
    """
    own = {p.name for p in (layout.format_file, layout.pool_id_file, layout.names_log,
                            layout.journal_log, layout.sync_cursor, layout.sync_names_cursor,
                            *layout.directories)}
    try:
        with os.scandir(layout.root) as it:
            others = sorted(e.name for e in it if e.name not in own
                            and e.name not in _BESIDE_A_NEW_POOL and not e.name.startswith("."))
    except OSError as exc:
        raise pool_error("cannot list the pool root", layout.root, exc) from exc
    if others:
        shown = ", ".join(repr(n) for n in others[:3]) + (", ..." if len(others) > 3 else "")
        raise PoolError(
            f"{layout.root} is not a distcache pool and holds other files ({shown}); a "
            "pool removes stale files from its tmp/ and locks/, so it is made only in a new "
            "or empty directory: point DISTCACHE_POOL (or --pool) at one",
            path=str(layout.root))


def refusal(root: Path, what: str) -> PoolError:
    """The error of a write (``what`` it would do) through a pool open read-only."""
    return PoolError(f"cannot {what}: the pool at {root} is open read-only, and nothing is "
                     "written through it; open it without read_only to change it",
                     path=str(root))


def peek(path: Path, what: str) -> str | None:
    """The stripped ASCII text of the small file ``path`` (``what`` it holds), or None
    when it is absent or empty (its creator has not written it yet); unlike
    :func:`~distcache.store._fs.read_small_file` it never waits, removes or creates.

    Raises:
        PoolError: it cannot be read.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise pool_error(f"cannot read the {what} in", path, exc) from exc
    try:
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    except OSError as exc:
        raise pool_error(f"cannot read the {what} in", path, exc) from exc
    finally:
        os.close(fd)
    return text or None


class ReadOnlyStore(ObjectStore):
    """The objects of a pool open read-only: read unstamped, a corrupt one left in
    place (a miss), every write refused."""

    def read(self, sha: str, *, stamp: bool, trusted: bool = False) -> bytes | None:
        return super().read(sha, stamp=False, trusted=trusted)

    def quarantine(self, sha: str, reason: str, st: os.stat_result | None,
                   path: str | None = None) -> None:
        path = self.layout.object_path(sha) if path is None else path
        logger.warning("%s %s; left in place (the pool is open read-only)", path, reason)

    def batch(self, *, wait: bool = True) -> contextlib.AbstractContextManager[None]:
        raise refusal(self.layout.root, "publish objects")

    @contextlib.contextmanager
    def staged(self, tag: str) -> Iterator[tuple[int, str]]:
        raise refusal(self.layout.root, "stage an object")
        yield -1, ""  # a generator, as the method it overrides

    def write(self, data: bytes | bytearray | memoryview, sha: str) -> bool:
        raise refusal(self.layout.root, f"store the object {sha}")

    def publish(self, fd: int, tmp: str, sha: str) -> bool:
        raise refusal(self.layout.root, f"publish the object {sha}")


class ReadOnlyIdentity(PoolIdentity):
    """The identity of a pool open read-only: its id as recorded, ``""`` when it has
    none yet (none is created); probes and renewals are refused.

    Raises:
        PoolError: the id cannot be read, or holds something else.
    """

    def __init__(self, layout: PoolLayout, *, host: str, mode: int) -> None:
        self._layout = layout
        self._host = host
        self._mode = mode
        text = peek(layout.pool_id_file, "pool id")
        if text is not None and not is_hex(text, 32):
            raise PoolError(f"{layout.pool_id_file} holds {text[:40]!r}, not a pool id "
                            "(32 hex digits); the pool root may be something else",
                            path=str(layout.pool_id_file))
        self.pool_id = text or ""

    @contextlib.contextmanager
    def probe(self, name: str, token: str) -> Iterator[bool]:
        raise refusal(self._layout.root, f"place the probe {name}")
        yield False  # a generator, as the method it overrides

    def renew(self) -> str:
        raise refusal(self._layout.root, "renew the pool id")
