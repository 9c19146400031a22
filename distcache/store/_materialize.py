"""Materializing: placing a pool object at ``<directory>/<name>`` for a caller.

This is the one place the pool writes outside its own root, into a directory the
caller named, under a name that is untrusted input (DESIGN.md, "Artifacts and the
pool"). The name is validated before any file is touched (``path_under``); each
directory below the caller's is created or opened inside the one above it, never
through a symlink, and refused when another user owns it; the file is then placed
in the directory held open, and a path that stops leading there is refused. It
arrives whole (a hard link, else a copy, renamed into place), so any number of
processes may materialize the same target at once. A file already at the target is
kept only when it is this user's and holds the right bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from distcache.artifact import Artifact, check_sha256, path_under
from distcache.errors import PoolError
from distcache.store._fs import (
    CREATE_FLAGS,
    NO_LINK,
    READ_FLAGS,
    hash_fd,
    pool_error,
    read_fd,
    unlink_quietly,
    write_all,
)
from distcache.store._objects import ObjectStore, check_size


def materialize(store: ObjectStore, artifact: Artifact, into_dir: str | os.PathLike[str]) -> Path:
    """Place ``artifact`` from ``store`` at ``into_dir/<name>`` and return that path.

    Raises:
        ArtifactNameError: the name is unsafe (checked before touching any file).
        IntegrityError: the object's size is not the artifact's.
        PoolError: the object is not in the pool, or the target cannot be written.
    """
    into = Path(os.path.abspath(into_dir))
    target = path_under(into, artifact.name)
    sha = check_sha256(artifact.sha256)
    data = store.read(sha, stamp=True)
    obj = store.layout.object_path(sha)
    if data is None:
        raise PoolError(
            f"cannot materialize {artifact.name}: {sha} is not in the pool at "
            f"{store.layout.root}; fetch it first",
            path=obj, errno=errno.ENOENT,
        )
    check_size(artifact, len(data), "pool")
    try:
        place_file(obj, into, target, sha, data, store.file_mode)
    except OSError as exc:
        if isinstance(exc, PoolError):
            raise
        raise pool_error("cannot materialize", target, exc) from exc
    return target


def place_file(obj: str, into: Path, target: Path, sha: str, data: bytes,
                     mode: int) -> None:
    """Place verified object ``obj`` (bytes ``data``) at ``target`` under ``into``: a
    hard link, else a ``mode`` copy, renamed into place; a correct target of this
    user's is kept. :class:`PoolError` for a symlink, or another user's directory, on
    the way; OSError on failure."""
    _ensure_dirs(into, target.parent)
    # Held open while the file is placed: the file is created, opened and renamed in
    # this directory, not by path (the one link made by path is checked against it),
    # so a directory on the way renamed or swapped for a symlink since its check
    # cannot move the file elsewhere.
    dir_fd = _open_dirs(into, target.parent, create=False)
    try:
        if not _kept(dir_fd, target.name, obj, sha, len(data)):
            _place(dir_fd, target.parent, obj, target.name, data, mode)
    finally:
        os.close(dir_fd)


def _kept(dir_fd: int, name: str, obj: str, sha: str, size: int) -> bool:
    """Whether ``name`` in ``dir_fd`` already is the placed file: this user's regular
    file (not followed through a link) that is the object itself or holds its bytes.
    Another user's file is not, whatever it holds: its owner could rewrite it once
    its path is handed back; it is replaced like a corrupt one."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                and st.st_size == size):
            return False
        with contextlib.suppress(OSError):  # the object may be collected meanwhile
            ost = os.lstat(obj)
            if (st.st_ino, st.st_dev) == (ost.st_ino, ost.st_dev):
                return True
        return hash_fd(fd, size) == (sha, size)
    except OSError:
        return False
    finally:
        os.close(fd)


#: Bytes of a file's name its temporary name keeps (with the process id, 12 hex digits
#: and the dots, well under the 255 bytes a name may have).
_TMP_STEM = 128


def _place(dir_fd: int, directory: Path, obj: str, name: str, data: bytes,
           mode: int) -> None:
    """Link ``obj`` (else copy ``data``, ``mode``) to a fresh name in the directory
    held as ``dir_fd`` (its path ``directory``) and rename it over ``name`` there.
    :class:`PoolError` when ``directory`` stops leading to that directory meanwhile."""
    # The name's first bytes only: a segment may take all 255 bytes a file name has.
    stem = name.encode("utf-8", "surrogateescape")[:_TMP_STEM].decode("utf-8", "ignore")
    tmp = f".{stem}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    try:
        try:
            # The linked file must be this user's regular file of the bytes verified:
            # the object may have been replaced since (by a symlink, another file),
            # and then the verified bytes are copied instead; so too when it was
            # collected (gc, prune) since its read, or its handle went stale (NFS).
            # The link is made by path: the directory is checked to be the held one
            # right before, and the link looked up in the held one right after; one
            # made elsewhere (a directory on the way swapped meanwhile) is removed.
            _check_leads(directory, os.fstat(dir_fd))
            os.link(obj, directory / tmp)
            if not _exists(dir_fd, tmp):
                unlink_quietly(directory / tmp)
                raise _moved(directory)
            linked = _holds(dir_fd, tmp, data)
        except OSError as exc:
            if isinstance(exc, PoolError) or (exc.errno not in _COPY_INSTEAD
                                              and exc.errno not in NO_LINK):
                raise
            linked = False
        if not linked:
            _unlink_quietly(dir_fd, tmp)
            fd = os.open(tmp, CREATE_FLAGS, 0o600, dir_fd=dir_fd)
            try:
                write_all(fd, data)
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        # The path handed back must lead to the file just placed, not to whatever a
        # renamed or swapped directory on the way now points at.
        _check_leads(directory / name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    finally:
        _unlink_quietly(dir_fd, tmp)


def _check_leads(path: Path, held: os.stat_result) -> None:
    """Raise :class:`PoolError` unless ``path`` leads to the file or directory of
    status ``held`` (same device and inode; links on the way followed, as whoever
    opens the path follows them)."""
    try:
        st: os.stat_result | None = os.stat(path)
    except OSError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != (held.st_dev, held.st_ino):
        raise _moved(path.parent if stat.S_ISREG(held.st_mode) else path)


def _moved(directory: Path) -> PoolError:
    return PoolError(
        f"{directory} changed while a file was placed in it (renamed, or swapped for a "
        "symlink); refusing to hand back a path that leads elsewhere",
        path=str(directory),
    )


def _exists(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is in ``dir_fd`` (not followed if a link)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


#: What ``link`` from the object answers when the verified bytes are copied instead:
#: another filesystem, or the object gone since it was read (collected, a stale handle).
_COPY_INSTEAD = frozenset({errno.EXDEV, errno.ENOENT, errno.ESTALE})
#: How a directory is opened: never blocking (below the caller's, also never through
#: a symlink: ``O_NOFOLLOW`` is added).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK


def _ensure_dirs(into: Path, parent: Path) -> None:
    """Create the directories from ``into`` down to ``parent`` that are missing, each
    checked as :func:`_open_dirs` checks it."""
    os.close(_open_dirs(into, parent, create=True))


def _open_dirs(into: Path, parent: Path, *, create: bool) -> int:
    """A descriptor of ``parent``, reached from ``into`` one directory at a time, each
    opened in the one above it (created first when ``create``).

    The caller's directory may be a symlink, or another user's (``/tmp``): they named
    it. Below it a symlink is refused, so a planted one cannot carry the write outside
    ``into``; so is another user's directory: its owner could swap it for a symlink
    between a check and the write, or replace the placed file in it at will.

    Raises:
        PoolError: a directory on the way is a symlink, not a directory, or another
            user's. OSError: one cannot be created or opened.
    """
    if create:
        os.makedirs(into, exist_ok=True)
    fd = os.open(into, _DIR_FLAGS)
    try:
        current = into
        for part in parent.relative_to(into).parts:
            current = current / part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            try:
                below = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                raise PoolError(
                    f"{current} is not a directory (a symlink?); refusing to write "
                    "through it", path=str(current), errno=exc.errno,
                ) from exc
            os.close(fd)
            fd = below
            owner = os.fstat(fd).st_uid
            if owner != os.geteuid():
                raise PoolError(
                    f"{current} belongs to uid {owner}, not to this user (uid "
                    f"{os.geteuid()}); refusing to write into it: its owner can replace "
                    "what is placed there", path=str(current), errno=errno.EPERM,
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlink_quietly(dir_fd: int, name: str) -> None:
    """Remove ``name`` from ``dir_fd`` if it can be removed; a cleanup never raises."""
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def _holds(dir_fd: int, name: str, data: bytes) -> bool:
    """Whether ``name`` in ``dir_fd`` is this user's regular file (not followed through
    a link) of exactly ``data``: another user's could be rewritten by its owner, so a
    link to it is no placed copy."""
    return _read_if(dir_fd, name, lambda st: stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                    and st.st_size == len(data)) == data


def _read_if(dir_fd: int | None, name: str | os.PathLike[str],
             admit: Callable[[os.stat_result], bool], flags: int = READ_FLAGS) -> bytes | None:
    """The bytes of ``name`` in ``dir_fd`` (None: a path as given), opened with
    ``flags`` (by default without following a link, nor blocking on a FIFO), when
    ``admit`` takes its status; None when it does not, or it cannot be read whole."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    try:
        st = os.fstat(fd)
        if not admit(st):
            return None
        data = read_fd(fd, st.st_size)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == st.st_size else None
