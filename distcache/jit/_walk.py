"""What a family's directory holds: the files a scan lists (not the names a tool
writes only while it works, nor another integration's directory), and the owner
check every directory, and the way to it, passes before it is filled or published.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from distcache.errors import JitCacheError

#: Names a tool writes while it works (temporary files, locks, build directories,
#: byte code stamped with a local time); never published.
TRANSIENT = ("*.tmp", "*.lock", "lock", ".*", "tmp.*", "*_CxxBuild", "__pycache__",
             "*.pyc", "locks")
#: Hidden names published all the same: ninja's build log and dependency log
#: (FlashInfer's JIT runs ninja in each op's directory; without them ninja rebuilds
#: every output it has no record of). Only ninja writes them, and only the
#: ``flashinfer_jit`` family's tool runs ninja in its directory.
KEPT = (".ninja_log", ".ninja_deps")
#: Directories at the top of a family's directory that hold another integration's
#: files, never published nor placed: FlashInfer's downloaded cubins
#: (``<FlashInfer's cache directory>/cubins``), which its loader integration serves.
FOREIGN = ("cubins",)


def transient(relpath: str, patterns: Sequence[str] = TRANSIENT) -> bool:
    """Whether any segment of ``relpath`` is a name tools write only while working."""
    return any(fnmatch.fnmatchcase(seg, pat) for seg in relpath.split("/") for pat in patterns)


def check_owner(directory: Path, *, family: str) -> None:
    """Refuse ``directory`` unless it is a directory owned by this process's user,
    not a symbolic link (whoever made the link chose where the files would go), and
    not one every user may write to without the sticky bit (:func:`open_to_all`:
    anyone could plant a file there that the tool loads).

    Raises:
        JitCacheError: it is owned by another user, is a link, is not a directory, or
            is writable by every user without the sticky bit (naming its mode, its
            owner and ``chmod go-w``).
    """
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise JitCacheError(f"{family}: cannot read {directory}: {exc}", family=family,
                            path=str(directory)) from exc
    if stat.S_ISLNK(st.st_mode):
        raise JitCacheError(
            f"{family}: refusing to fill {directory}: it is a symbolic link (to "
            f"{os.readlink(directory)!r}); point the tool at the directory itself",
            family=family, path=str(directory))
    if not stat.S_ISDIR(st.st_mode):
        raise JitCacheError(f"{family}: {directory} is not a directory", family=family,
                            path=str(directory))
    if st.st_uid != os.geteuid():
        raise JitCacheError(
            f"{family}: refusing to fill {directory}: it belongs to uid {st.st_uid}, not "
            f"to this user (uid {os.geteuid()}); a JIT cache holds code the engine runs, "
            "so point the tool at a directory of your own", family=family,
            path=str(directory))
    if open_to_all(st):
        raise JitCacheError(
            f"{family}: refusing to use {directory}: every user may write to it (mode "
            f"{oct(stat.S_IMODE(st.st_mode))}, no sticky bit; owner uid {st.st_uid}), so "
            "another user could plant compiled code the engine would load; run "
            f"chmod go-w {directory} (or point the tool at a directory of your own) and "
            "run again", family=family, path=str(directory))


def open_to_all(st: os.stat_result) -> bool:
    """Whether every user may add, rename or remove entries of the directory ``st``
    describes (world-writable without the sticky bit)."""
    return bool(st.st_mode & stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX


#: How many symbolic links the way to a directory may pass through (as for one path
#: the kernel resolves).
MAX_LINKS = 40


def check_way(directory: Path, *, family: str, create: bool = False) -> bool:
    """Check ``directory`` (:func:`check_owner`) and every directory on the way to it,
    creating the missing ones when ``create`` (one at a time, each checked once
    made); whether ``directory`` exists.

    A directory on the way (``/`` included) must belong to this user or to root, and
    one that every user may write to must have the sticky bit (``/tmp``): whoever
    owns a directory, or may rename what it holds, chooses where the files under it
    go. A symbolic link on the way is followed only where this user or root made it
    (a home directory on another disk), and the way to its target is checked the
    same.

    Raises:
        JitCacheError: ``directory`` or a directory or link on the way fails the
            check, the way passes more than :data:`MAX_LINKS` links, or a missing
            directory cannot be created (:class:`WholeFilesystem` where its
            filesystem is full or read-only), naming the family and the directory.
    """
    me = os.geteuid()
    todo = list(reversed(Path(os.path.abspath(directory)).parts[1:]))
    here = "/"
    _check_on_way(here, _lstat(here, family), me, family)
    links = 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":  # from a link's target; ``here`` has no links in it
            here = os.path.dirname(here)
            continue
        path = os.path.join(here, name)
        st = _lstat(path, family)
        if st is None:
            if not create:
                return False
            _make_dir(path, directory, family)
            st = _lstat(path, family)
        if not todo:  # ``directory`` itself
            check_owner(Path(path), family=family)
            return True
        if st is not None and stat.S_ISLNK(st.st_mode):
            links += 1
            if st.st_uid not in (me, 0):
                raise JitCacheError(
                    f"{family}: refusing to fill {directory}: {path} on the way is a "
                    f"symbolic link made by uid {st.st_uid}, not by this user (uid {me}) "
                    "nor by root", family=family, path=path)
            if links > MAX_LINKS:
                raise JitCacheError(f"{family}: the way to {directory} passes more than "
                                    f"{MAX_LINKS} symbolic links", family=family, path=path)
            target = os.readlink(path)
            if os.path.isabs(target):
                here = "/"
            todo.extend(reversed(target.split("/")))
            continue
        _check_on_way(path, st, me, family)
        here = path
    check_owner(Path(here), family=family)  # ``directory`` is ``/``
    return True


def _make_dir(path: str, directory: Path, family: str) -> None:
    """Create ``path``, on the way to the cache ``directory`` (or that directory).

    Raises:
        JitCacheError: it cannot be created (:class:`WholeFilesystem` for a full or
            read-only filesystem), with what to do.
    """
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except OSError as exc:
        message = (f"{family}: cannot create {path} for the cache directory {directory}: "
                   f"{exc.strerror or exc}; create it, or point the tool's cache variable "
                   "at a directory this user can write, and run again")
        if exc.errno in WHOLE_FS:
            raise WholeFilesystem(message, family=family, path=path, errno=exc.errno) from exc
        raise JitCacheError(message, family=family, path=path) from exc


def _lstat(path: str, family: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JitCacheError(f"{family}: cannot read {path}: {exc}", family=family,
                            path=path) from exc


def _check_on_way(path: str, st: os.stat_result | None, me: int, family: str) -> None:
    """Refuse a directory on the way that is missing, not a directory, another
    user's, or one every user may change."""
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise JitCacheError(f"{family}: {path} is on the way to the cache directory but "
                            "is not a directory", family=family, path=path)
    if st.st_uid not in (me, 0):
        raise JitCacheError(
            f"{family}: refusing to fill under {path}: it belongs to uid {st.st_uid}, not "
            f"to this user (uid {me}) nor to root", family=family, path=path)
    if open_to_all(st):
        raise JitCacheError(
            f"{family}: refusing to fill under {path}: every user may write to it (mode "
            f"{oct(stat.S_IMODE(st.st_mode))}, no sticky bit; owner uid {st.st_uid}), so "
            f"anyone may replace what it holds; run chmod go-w {path} (or chmod +t, or "
            "point the tool at a directory elsewhere) and run again", family=family,
            path=path)


def whole_filesystem(family: str, target: Path, exc: OSError) -> WholeFilesystem:
    """The error that stops placing ``target`` and every file after it (``exc``'s
    errno is one of :data:`WHOLE_FS`, or it is a :class:`LinkRefused`), with what to
    do."""
    if isinstance(exc, LinkRefused):
        remedy = ("its filesystem cannot hard-link files, which placing a file without "
                  "ever replacing one needs; give the cache a directory on a filesystem "
                  "that can (a local disk)")
    else:
        remedy = ("make room on its filesystem (or give the cache a writable directory) "
                  "and run again")
    return WholeFilesystem(f"{family}: cannot write {target} from the pool: "
                           f"{exc.strerror or exc}; {remedy}", family=family,
                           path=str(target), errno=exc.errno)


class InTheWay(Exception):
    """Something other than a directory or a link (a stale file) where a tree has a
    directory: the entries under it are left out, the others placed."""


class Refused(JitCacheError):
    """A directory below the root that is a symbolic link or another user's: nothing
    is written through it; the entries under it are left out, the others placed."""


#: Errors of a filesystem as a whole (full, over quota, read-only): they stop a
#: materialisation rather than fail every file in turn.
WHOLE_FS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
#: What ``link`` fails with on a filesystem without hard links (some FUSE and
#: object-store mounts): a file is placed by linking its temporary copy into place,
#: which never replaces one that a compile got to first, so nothing can be placed.
NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS})


class LinkRefused(OSError):
    """Linking a placed file's temporary copy into place failed with one of
    :data:`NO_LINKS`: the filesystem cannot place any file."""


class Uncreatable(Refused):
    """A directory below the root that cannot be created (not a full or read-only
    filesystem: a name it refuses, a directory without write permission): the
    entries under it are missing, for the tool to build; the others are placed."""


class WholeFilesystem(JitCacheError, OSError):
    """The filesystem of a family's directory refuses every write (full, over quota,
    read-only, or without hard links): placing into that directory stops. Also an :class:`OSError`, whose
    ``errno`` it keeps. Attributes: ``family``, ``path`` (the file or directory being
    written), ``errno``."""

    attributes = ("path", "errno")


def ensure_dirs(root: Path, directory: Path, checked: set[Path], family: str) -> Path:
    """Create the directories from ``root`` to ``directory``; refuse a symbolic link
    or another user's directory on the way (:class:`Refused`), or one that cannot be
    created (:class:`Uncreatable`): the entries under it are left out, the others
    placed; raise :class:`InTheWay` for a file in the way.

    Raises:
        WholeFilesystem: the filesystem is full or read-only (nothing more can be
            placed in it).
    """
    missing: list[Path] = []
    here = directory
    while here not in checked:
        missing.append(here)
        here = here.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            pass
        except OSError as exc:
            message = f"{family}: cannot create {path}: {exc.strerror or exc}"
            if exc.errno in WHOLE_FS:
                raise WholeFilesystem(
                    f"{message}; make room on its filesystem (or give the cache a writable "
                    "directory) and run again", family=family, path=str(path),
                    errno=exc.errno) from exc
            raise Uncreatable(message, family=family, path=str(path)) from exc
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise Refused(f"{family}: {path} is a symbolic link; refusing to write "
                          "through it", family=family, path=str(path))
        if not stat.S_ISDIR(st.st_mode):
            raise InTheWay(path)
        if st.st_uid != os.geteuid() or open_to_all(st):
            try:
                check_owner(path, family=family)
            except JitCacheError as exc:
                raise Refused(str(exc), family=family, path=str(path)) from None
        checked.add(path)
    return directory


def walk(root: Path) -> Iterator[tuple[str, Path]]:
    """``(relative path, path)`` of every regular file under ``root`` (symbolic links
    are not followed and not listed; transient names but :data:`KEPT` ones, and the
    :data:`FOREIGN` directories at the top, are skipped)."""
    stack = [root]
    while stack:
        here = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            rel = Path(entry.path).relative_to(root).as_posix()
            if (transient(entry.name) and entry.name not in KEPT) or rel in FOREIGN:
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                yield rel, Path(entry.path)
