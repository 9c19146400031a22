"""Files and bytes the loader wrapper handles: the files in FlashInfer's cubin
directory, writing one whole, and an origin that keeps what it delivered."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from distcache.artifact import Artifact, path_under, sha256_hex
from distcache.origins._base import Asked
from distcache.store._fs import process_umask
from distcache.store._materialize import _ensure_dirs

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


def valid_bytes(root: Path, artifact: Artifact) -> bytes | None:
    """The bytes of ``root/<name>`` when that file exists and matches the sha256."""
    try:
        data = path_under(Path(root), artifact.name).read_bytes()
    except OSError:
        return None
    return data if sha256_hex(data) == artifact.sha256 else None


def placed(root: Path, artifact: Artifact) -> bool:
    """Whether ``root/<name>`` is already the artifact: its bytes, and not a symlink
    (one planted there points wherever its owner likes, now or later; the pool's
    materialize replaces it with a file)."""
    try:
        if stat.S_ISLNK(os.lstat(path_under(Path(root), artifact.name)).st_mode):
            return False
    except OSError:
        return False
    return valid_bytes(root, artifact) is not None


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
