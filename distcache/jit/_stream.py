"""A cache file into the pool a piece at a time: hashed, then copied, never held
whole in memory (a compiled artifact may run to gigabytes).

The pool stores bytes it is given whole, so a file to store is first copied, a piece
at a time and hashed again on the way, into an unnamed private file in the pool's
``tmp/``, whose pages are then handed to the pool mapped rather than read: the tool's
file itself is never mapped (a tool truncating it mid-read would kill this process
with ``SIGBUS``), and a copy that does not hash to what the scan read (the tool
rewrote the file in between) is not stored.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
from collections.abc import Callable
from typing import IO, TypeVar

from distcache.errors import PoolError
from distcache.store import ArtifactPool

T = TypeVar("T")

#: How much of a file is read, hashed or copied at a time.
CHUNK = 1 << 20
#: Files up to this size are stored from one read; larger ones through a staged copy.
SMALL = 16 << 20


def store_fd(pool: ArtifactPool, fd: int, sha: str, size: int) -> bool:
    """Store the ``size`` bytes of ``fd`` (read at their offsets) in ``pool`` as
    ``sha``; ``False``, storing nothing, when they no longer hash to ``sha`` (the file
    changed since it was hashed).

    Raises:
        PoolError: the pool cannot be written (nor its ``tmp/`` a copy staged in).
        OSError: ``fd`` cannot be read.
    """
    if size <= SMALL:  # read whole: a staged copy would cost more than it saves
        data = os.pread(fd, size + 1, 0)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            return False
        pool.put(data, sha)
        return True
    with _staging(pool) as staged:
        digest, at = hashlib.sha256(), 0
        while at < size and (chunk := os.pread(fd, min(CHUNK, size - at), at)):
            digest.update(chunk)
            _staged(pool, staged.write, chunk)
            at += len(chunk)
        _staged(pool, lambda _: staged.flush(), b"")
        if at != size or os.pread(fd, 1, size) or digest.hexdigest() != sha:
            return False
        with _staged(pool, lambda _: mmap.mmap(staged.fileno(), size, prot=mmap.PROT_READ),
                     b"") as mapped:
            view = memoryview(mapped)
            try:
                pool.put(view, sha)
            finally:
                view.release()
    return True


def _staged(pool: ArtifactPool, step: Callable[[bytes], T], data: bytes) -> T:
    """``step(data)`` on the staged copy; its failure (a full disk, a quota) is the
    pool's, a :class:`PoolError` naming the pool: never taken for the tool's file
    changing, which leaves the file out without a word."""
    try:
        return step(data)
    except OSError as exc:
        if isinstance(exc, PoolError):
            raise
        raise PoolError(f"cannot stage a file for the pool {pool.root} in {pool.layout.tmp}: "
                        f"{exc.strerror or exc}; check that this user can write the pool and "
                        "that its filesystem has room",
                        path=str(pool.layout.tmp), errno=exc.errno) from exc


def _staging(pool: ArtifactPool) -> IO[bytes]:
    """An unnamed private file in ``pool``'s ``tmp/`` (gone once closed, or when this
    process dies).

    Raises:
        PoolError: it cannot be created (a pool opened read-only, a full disk).
    """
    return _staged(pool, lambda _: tempfile.TemporaryFile(dir=pool.layout.tmp, prefix="jit."),
                   b"")
