"""Persistent per-rank workspace slots: ``<root>/rank-N``, one holder at a time.

A slot is held through a kernel lock (``flock``) on ``<root>/rank-N/.lock``. The
kernel drops the lock when the holder's file descriptor closes, including when the
holder is killed, so a crashed job never leaves a slot blocked. A busy slot is skipped
and the next index tried, as engines do with their per-rank scratch directories; a
slot keeps its contents between runs (compiled kernels, caches), which is the point.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import weakref
from pathlib import Path
from types import TracebackType

from distcache._log import get_logger
from distcache.errors import WorkspaceError

log = get_logger(__name__)

LOCK_NAME = ".lock"
MAX_SLOTS = 4096


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # closing the descriptor releases the flock


class WorkspaceSlot:
    """A held slot. Release with :meth:`release` or by leaving the ``with`` block;
    the lock is also released when the object is collected or the process exits."""

    def __init__(self, path: Path, index: int, fd: int) -> None:
        self.path = path
        self.index = index
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, _close, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Release the slot; idempotent. Its contents stay for the next holder."""
        if self._fd is not None:
            self._fd = None
            self._finalizer()

    def __enter__(self) -> WorkspaceSlot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"WorkspaceSlot({str(self.path)!r}, index={self.index}, {state})"


def _refusal(path: Path, exc: OSError) -> WorkspaceError:
    """What cannot be done with ``path`` (a slot or its lock file), and what to do."""
    # The file the call failed on: a parent of a slot being made, else ``path`` itself.
    name = exc.filename if isinstance(exc.filename, str) and os.path.isabs(exc.filename) else None
    where = Path(name) if name is not None else path
    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
        try:
            target = f" (to {os.readlink(path)})"
        except OSError:
            target = ""
        why = (f"{path} is a symbolic link{target}, which a workspace slot never follows "
               "(its files would be written where the link points); remove the link")
    elif exc.errno in (errno.EEXIST, errno.ENOTDIR):
        # The first component on the way that is there but is no directory.
        where = next((p for p in (*reversed(path.parents), path)
                      if os.path.lexists(p) and not p.is_dir()), where)
        why = (f"{where} exists and is not a directory (a file, or a symbolic link to a "
               "missing directory); remove it")
    elif exc.errno in (errno.EACCES, errno.EPERM):
        owner = ""
        for held in (where, where.parent):  # a lock file not made yet: its directory's
            with contextlib.suppress(OSError):
                owner, where = f", owned by uid {os.stat(held).st_uid}", held
                break
        why = (f"permission denied on {where}{owner}, and this process runs "
               f"as uid {os.geteuid()}; give --workspace a directory of this user's own")
    else:
        why = str(exc)
    return WorkspaceError(f"cannot use workspace slot {path}: {why}", path=str(path))


def _try_lock(slot: Path) -> int | None:
    try:
        slot.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _refusal(slot, exc) from exc
    # Neither the slot nor its lock file is reached through a symbolic link: one planted
    # in a shared directory would have the lock file truncated, and PROGRAM's files
    # written, wherever it points.
    try:
        where = os.open(slot, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _refusal(slot, exc) from exc
    try:
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=where)
    except OSError as exc:
        raise _refusal(slot / LOCK_NAME, exc) from exc
    finally:
        os.close(where)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        # ENOLCK/EOPNOTSUPP: a filesystem without locks cannot keep slots exclusive.
        raise WorkspaceError(
            f"cannot lock workspace slot {slot} ({exc}); put the workspace on a "
            "filesystem that supports flock (a node-local disk)",
            path=str(slot),
        ) from exc
    # Who holds it, for a person looking at a busy slot; never read for correctness, so
    # a full disk (or a file size limit) does not keep a warm slot from being used.
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
    return fd


def acquire_slot(root: str | os.PathLike[str], start: int = 0) -> WorkspaceSlot:
    """Hold the first free slot ``<root>/rank-N`` with ``N >= start``.

    Pass the rank as ``start``, so that each rank finds its own slot again on the next
    launch unless another process holds it.

    Raises:
        WorkspaceError: the slot cannot be created or locked, or ``MAX_SLOTS`` slots
            from ``start`` on are all busy.
        ValueError: ``start`` is negative.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    base = Path(root).absolute()
    for index in range(start, start + MAX_SLOTS):
        slot = base / f"rank-{index}"
        fd = _try_lock(slot)
        if fd is not None:
            if index != start:
                log.info("workspace slot rank-%d is busy; using %s", start, slot)
            return WorkspaceSlot(slot, index, fd)
    raise WorkspaceError(
        f"all {MAX_SLOTS} workspace slots from {base}/rank-{start} on are busy",
        path=str(base),
    )
