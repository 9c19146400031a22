"""Materializing: placing a pool object at ``<directory>/<name>`` for a caller.

This is the one place the pool writes outside its own root, into a directory the
caller named, under a name that is untrusted input (DESIGN.md, "Artifacts and the
pool"). The name is validated before any file is touched (``path_under``); each
directory below the caller's is created or checked with ``lstat``, never walked
through a symlink; the file arrives whole (a hard link, else a copy, renamed into
place), so any number of processes may materialize the same target at once.
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
    pool_error,
    read_fd,
    unlink_quietly,
    write_all,
)
from distcache.store._objects import ObjectStore, check_size
from distcache.store._reading import file_holds


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
    hard link, else a ``mode`` copy, renamed into place; a correct target is kept.
    :class:`PoolError` for a symlinked directory on the way, OSError on failure."""
    _ensure_dirs(into, target.parent)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode):
        with contextlib.suppress(OSError):  # the object may be collected meanwhile
            ost = os.lstat(obj)
            if (st.st_ino, st.st_dev) == (ost.st_ino, ost.st_dev):
                return
        if st.st_size == len(data) and file_holds(target, sha):
            return
    tmp = os.path.join(target.parent, f".{target.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    try:
        try:
            # The linked file must be this user's regular file of the bytes verified:
            # the object may have been replaced since (by a symlink, another file),
            # and then the verified bytes are copied instead; so too when it was
            # collected (gc, prune) since its read, or its handle went stale (NFS).
            os.link(obj, tmp)
            linked = _holds(tmp, data)
        except OSError as exc:
            if exc.errno not in _COPY_INSTEAD and exc.errno not in NO_LINK:
                raise
            linked = False
        if not linked:
            unlink_quietly(tmp)
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


#: What ``link`` from the object answers when the verified bytes are copied instead:
#: another filesystem, or the object gone since it was read (collected, a stale handle).
_COPY_INSTEAD = frozenset({errno.EXDEV, errno.ENOENT, errno.ESTALE})


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


def _holds(path: str, data: bytes) -> bool:
    """Whether ``path`` is this user's regular file (not followed through a link) of
    exactly ``data``: another user's could be rewritten by its owner, so a link to it
    is no placed copy."""
    return _read_if(path, lambda st: stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                    and st.st_size == len(data)) == data


def _read_if(path: str | Path, admit: Callable[[os.stat_result], bool]) -> bytes | None:
    """``path``'s bytes, opened without following a link, when ``admit`` takes its
    status; None when it does not, or the file cannot be read whole."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
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
