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
from distcache.store._fs import READ_FLAGS, hash_fd, process_umask, read_fd
from distcache.store._materialize import _ensure_dirs, _open_dirs, _read_if

if TYPE_CHECKING:
    from distcache.origins import Origin


class Keeping(Asked):
    """``origin``, noting whether it was asked (``asked``: this process downloaded)
    and keeping hold of the verified bytes it delivered to the pool, so that a
    publication that fails after them does not cost a second download.

    What the origin streams into the pool's file is held by a duplicate of that
    file's descriptor, not copied into memory: the pool returns the bytes itself
    when it publishes them, and a second copy of an artifact of hundreds of
    megabytes would double every download's peak. :attr:`kept` reads them back (the
    page cache) only when asked, after the pool's file is gone. A context manager:
    leaving it closes the descriptor."""

    def __init__(self, origin: Origin) -> None:
        super().__init__(origin)
        self._data: bytes | None = None  #: what ``fetch`` returned
        self._fd: int | None = None  #: the pool's file, from ``_start``
        self._start = 0

    def __enter__(self) -> Keeping:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the pool's file (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def kept(self) -> bytes | None:
        """The bytes the origin delivered, or ``None`` when there were none or they
        cannot be read back (the caller checks their sha256 either way)."""
        if self._data is not None or self._fd is None:
            return self._data
        try:
            size = os.fstat(self._fd).st_size - self._start
            parts, got = [], 0
            while got < size and (chunk := os.pread(self._fd, size - got, self._start + got)):
                parts.append(chunk)
                got += len(chunk)
        except OSError:
            return None
        return b"".join(parts)

    def fetch(self, artifact: Artifact) -> bytes:
        self._data = super().fetch(artifact)
        return self._data

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        start = out.tell()
        if hasattr(self._origin, "fetch_into"):
            size = super().fetch_into(artifact, out)
        else:  # written, then dropped: the pool's file holds it
            data = super().fetch(artifact)
            out.write(data)
            size = len(data)
            del data
        try:
            out.flush()
            fd = os.dup(out.fileno())
        except (OSError, ValueError, AttributeError):  # no descriptor to hold
            return size
        self.close()
        self._fd, self._start = fd, start
        return size


def own_bytes(root: Path, target: Path) -> bytes | None:
    """The bytes of ``target`` (a path under ``root``) when it is this user's regular
    file, reached from ``root`` through this user's directories without following a
    symlink at any of them or at the file (opened as the pool's materialize opens its
    targets); ``None`` otherwise, or when it cannot be read whole.

    Only such a file may be left in place: another user's, or one reached through a
    link, can be rewritten by its owner after it was checked, and FlashInfer opens it
    by path. ``None`` makes the caller replace it."""
    opened = _own_fd(root, target)
    if opened is None:
        return None
    fd, size = opened
    try:
        data = read_fd(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == size else None


def _own_fd(root: Path, target: Path) -> tuple[int, int] | None:
    """A descriptor and the size of ``target`` when :func:`own_bytes` would read it,
    else ``None``; the caller closes the descriptor."""
    try:
        dir_fd = _open_dirs(Path(root), target.parent, create=False)
    except (OSError, ValueError):
        return None
    try:
        fd = os.open(target.name, READ_FLAGS, dir_fd=dir_fd)
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            return fd, st.st_size
    except OSError:
        pass
    os.close(fd)
    return None


#: How much of a file is read at a time where it is only compared.
_CHUNK = 1 << 20


def own_digest(root: Path, target: Path) -> str | None:
    """The sha256 of ``target`` when :func:`own_bytes` would read it, else ``None``;
    hashed a piece at a time. ``None`` too when it cannot be read to the end its
    ``fstat`` gave (a file growing or shrinking meanwhile)."""
    opened = _own_fd(root, target)
    if opened is None:
        return None
    fd, size = opened
    try:
        digest, got = hash_fd(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    return digest if got == size else None


def own_holds(root: Path, target: Path, data: bytes) -> bool:
    """Whether ``target`` is a file :func:`own_bytes` would read and holds exactly
    ``data``; compared a piece at a time, and not read at all when its size differs."""
    opened = _own_fd(root, target)
    if opened is None:
        return False
    fd, size = opened
    try:
        return fd_holds(fd, size, data)
    finally:
        os.close(fd)


def fd_holds(fd: int, size: int, data: bytes) -> bool:
    """Whether the file open at ``fd``, whose ``fstat`` said ``size``, holds exactly
    ``data``: compared a piece at a time (never a second copy of ``data``), and not
    read at all when the sizes differ. ``False`` when it cannot be read."""
    if size != len(data):
        return False
    view, at = memoryview(data), 0
    try:
        while chunk := os.pread(fd, _CHUNK, at):
            if view[at:at + len(chunk)] != chunk:
                return False
            at += len(chunk)
    except OSError:
        return False
    return at == len(data)


def regular_bytes(path: Path) -> bytes | None:
    """The bytes of the regular file at ``path`` (a symlink followed), or ``None``
    for anything else or a file that cannot be read whole.

    Opened without blocking and checked on the open descriptor: a FIFO there would
    block ``open`` until a writer came (FlashInfer's C++ side waits meanwhile in its
    ctypes callback), and a device (a link to ``/dev/zero``) would never end."""
    return _read_if(None, path, lambda st: stat.S_ISREG(st.st_mode),
                    os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)


def cubin_bytes(root: Path, artifact: Artifact) -> tuple[bytes | None, bool]:
    """The bytes of ``root/<name>`` when that file matches the sha256 (else ``None``),
    and whether it is already the artifact, to be left in place (a file
    :func:`own_bytes` trusts). The file is read once: a trusted file with other bytes
    is not read again through its path."""
    try:
        path = path_under(Path(root), artifact.name)
    except ValueError:  # an unsafe name
        return None, False
    data = own_bytes(Path(root), path)
    trusted = data is not None
    if data is None:
        data = regular_bytes(path)
    if data is None or sha256_hex(data) != artifact.sha256:
        return None, False
    return data, trusted


def placed(root: Path, artifact: Artifact) -> bool:
    """Whether ``root/<name>`` is already the artifact (:func:`own_digest`);
    when it is not, the pool's materialize replaces it with this user's file."""
    try:
        return own_digest(Path(root), path_under(Path(root), artifact.name)) == artifact.sha256
    except ValueError:  # an unsafe name
        return False


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
    if own_holds(Path(root), target, data) or is_installed_location(Path(root)):
        return False
    write_replacing(Path(root), target, data)
    return True
