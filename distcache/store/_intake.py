"""An origin's bytes into the pool: streamed into a staged file, checked against the
artifact, published. :class:`~distcache.store._pool.ArtifactPool` calls these for its
``download`` and for a miss of its ``fetch``; ``published(sha, size)`` is the pool's
record of a publication (its journal and its size cap)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import IntegrityError, PoolError
from distcache.store._fs import pool_error
from distcache.store._objects import ObjectStore, check_size

if TYPE_CHECKING:
    from distcache.origins import Origin


def stream_in(fd: int, tmp: str, artifact: Artifact, origin: Origin) -> int:
    """The origin's bytes of ``artifact`` into ``fd`` (the staged file ``tmp``); their
    size (PoolError: they cannot be written)."""
    try:
        with open(fd, "w+b", closefd=False) as out:
            origin.fetch_into(artifact, out)
            out.flush()
        return os.fstat(fd).st_size
    except PoolError:
        raise
    except OSError as exc:
        # A full disk or quota shows up as a bare OSError from the origin's write.
        raise pool_error("cannot write", tmp, exc) from exc


def download_streamed(store: ObjectStore, artifact: Artifact, origin: Origin,
                      published: Callable[[str, int], None]) -> int:
    """Stream ``artifact`` into ``store`` (the origin verifies as the bytes stream in:
    its contract), publish it, return its size."""
    with store.staged(artifact.sha256[:16]) as (fd, tmp):
        size = stream_in(fd, tmp, artifact, origin)
        check_size(artifact, size, origin.describe())
        if store.publish(fd, tmp, artifact.sha256):
            published(artifact.sha256, size)
        return size


def download_bytes(store: ObjectStore, artifact: Artifact, origin: Origin,
                   published: Callable[[str, int], None]) -> bytes:
    """Stream ``artifact`` into ``store``, hash it here, publish it and return its bytes.

    Raises:
        IntegrityError: the bytes do not match the sha256 (or size).
    """
    source = origin.describe()
    with store.staged(artifact.sha256[:16]) as (fd, tmp):
        data = pread_all(fd, stream_in(fd, tmp, artifact, origin))
        actual = sha256_hex(data)
        if actual != artifact.sha256:
            raise IntegrityError(
                f"sha256 mismatch for {artifact.name} from {source}: expected "
                f"{artifact.sha256}, got {actual}; check the origin",
                sha256=artifact.sha256, actual=actual, source=source,
            )
        check_size(artifact, len(data), source)
        if store.publish(fd, tmp, artifact.sha256):
            published(artifact.sha256, len(data))
        return data


def pread_all(fd: int, size: int) -> bytes:
    """The first ``size`` bytes of ``fd`` (fewer where it is shorter), read at their
    offsets: one ``pread`` returns at most about 2 GiB on Linux, whatever it is asked."""
    data = os.pread(fd, size, 0)
    if len(data) >= size or not data:
        return data
    parts, got = [data], len(data)
    while got < size and (chunk := os.pread(fd, size - got, got)):
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
