"""Files and bytes the loader wrapper handles: the files in FlashInfer's cubin
directory, writing one whole, keeping given bytes at the path FlashInfer opens, and an
origin that keeps what it delivered."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from distcache.artifact import Artifact, path_under, sha256_hex
from distcache.integrations.flashinfer._upstream import is_installed_location
from distcache.origins._base import Asked
from distcache.store._fs import process_umask
from distcache.store._materialize import _ensure_dirs, _open_dirs, _read_if

if TYPE_CHECKING:
    from distcache.origins import Origin


class Keeping(Asked):
    """``origin``, noting whether it was asked (``asked``: this process downloaded)
    and keeping a copy of the verified bytes it delivered to the pool, so that a
    publication that fails after them does not cost a second download."""

    def __init__(self, origin: Origin) -> None:
        super().__init__(origin)
        self.kept: bytes | None = None

    def fetch(self, artifact: Artifact) -> bytes:
        self.kept = super().fetch(artifact)
        return self.kept

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        if not hasattr(self._origin, "fetch_into"):
            data = self.fetch(artifact)
            out.write(data)
            return len(data)
        start = out.tell()
        size = super().fetch_into(artifact, out)
        try:
            # The pool's own temporary file: read back what was just written (page cache).
            out.seek(start)
            self.kept = out.read()
        except (OSError, ValueError):
            self.kept = None
        return size


def own_bytes(root: Path, target: Path) -> bytes | None:
    """The bytes of ``target`` (a path under ``root``) when it is this user's regular
    file, reached from ``root`` through this user's directories without following a
    symlink at any of them or at the file (opened as the pool's materialize opens its
    targets); ``None`` otherwise.

    Only such a file may be left in place: another user's, or one reached through a
    link, can be rewritten by its owner after it was checked, and FlashInfer opens it
    by path. ``None`` makes the caller replace it."""
    try:
        dir_fd = _open_dirs(Path(root), target.parent, create=False)
    except (OSError, ValueError):
        return None
    try:
        return _read_if(dir_fd, target.name, _own_file)
    finally:
        os.close(dir_fd)


def _own_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def valid_bytes(root: Path, artifact: Artifact, *, own: bool = False) -> bytes | None:
    """The bytes of ``root/<name>`` when that file exists and matches the sha256; with
    ``own``, only when it is also a file :func:`own_bytes` trusts (then it is already
    the artifact, to be left in place)."""
    try:
        path = path_under(Path(root), artifact.name)
        data = own_bytes(Path(root), path) if own else path.read_bytes()
    except (OSError, ValueError):  # ValueError: an unsafe name
        return None
    return data if data is not None and sha256_hex(data) == artifact.sha256 else None


def placed(root: Path, artifact: Artifact) -> bool:
    """Whether ``root/<name>`` is already the artifact (``valid_bytes(own=True)``);
    when it is not, the pool's materialize replaces it with this user's file."""
    return valid_bytes(root, artifact, own=True) is not None


def write_replacing(root: Path, target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` (a path under ``root``) whole: a temporary file
    beside it renamed over it, so a reader sees the old file or the new one, never a
    part. ``OSError`` as it comes.

    Like the pool's materialize, each directory below ``root`` is created or checked
    without following a link (:class:`~distcache.errors.PoolError`, an ``OSError``,
    for a symlink another user planted there), and the file gets the mode FlashInfer
    would give it (``0666`` less the umask), so a cubin directory shared by several
    users stays readable to all of them."""
    _ensure_dirs(Path(root), target.parent)
    fd, tmp = tempfile.mkstemp(prefix=".distcache-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o666 & ~process_umask())
            out.write(data)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def hold(root: Path, name: str, data: bytes) -> bool:
    """Make ``root/<name>``, the path FlashInfer opens after asking for ``name``
    (``FLASHINFER_CUBIN_DIR / name``), hold ``data``; returns whether it wrote.

    A file there is left alone when it is this user's, reached without a link
    (:func:`own_bytes`), and holds exactly ``data``: compared, not hashed, since
    ``data`` is what the caller is about to be given. Anything else there (missing,
    other bytes, another user's file, a symlink) is replaced by
    :func:`write_replacing`, which never writes through a link. An installation
    directory (site-packages) is never written.

    Raises:
        ValueError: ``name`` is not a relative path that stays under ``root``.
        OSError: the write failed (:class:`~distcache.errors.PoolError` for a
            directory on the way that is a symlink or another user's).
    """
    relative = Path(name)
    if not relative.parts or relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{name!r} does not name a file under {root}")
    target = Path(root) / relative
    if own_bytes(Path(root), target) == data or is_installed_location(Path(root)):
        return False
    write_replacing(Path(root), target, data)
    return True
