"""A pool's identity: the ``pool_id`` file, and the probes that show which processes
see the same pool directory.

``pool_id`` is written once, at creation, so a pool copied whole (baked into a
container image, rsync'd to node-local disks, ``cp -a``) carries its template's id:
equal ids do not prove one directory. A collective therefore asks for proof before
it lets ranks share a writer (:func:`distcache.collective._sharing.agree_pools`):
one rank places a probe, a file named and filled for this run only, and each other
claimant must find it with that content. A copy then takes a fresh id
(:meth:`PoolIdentity.renew`), once, so that later runs see distinct ids and pay for
no more than one probe per pool.

Probes are created in ``tmp/`` (:meth:`~distcache.store.layout.PoolLayout.probe_path`),
readable by everyone who may read the pool, and removed when the check ends; one left
by a killed process is swept with the other stale temporary files. Their names are
fresh random hex for each run, so concurrent jobs never confuse each other's probes,
and no client cache (NFS's negative lookup cache) can remember a name as missing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from distcache._events import emit
from distcache._log import get_logger
from distcache.errors import PoolError
from distcache.store._fs import (
    CREATE_FLAGS,
    READ_FLAGS,
    create_once,
    fsync_dir,
    is_hex,
    pool_error,
    read_small_file,
    temp_file,
    unlink_quietly,
    write_all,
)
from distcache.store._locking import FileLock
from distcache.store.layout import PoolLayout

logger = get_logger(__name__)

#: Seconds a renewal waits for another process renewing the same pool.
_RENEW_LOCK_TIMEOUT = 10.0


def new_pool_id() -> str:
    """A fresh pool id: 32 random hex digits."""
    return os.urandom(16).hex()


def load_pool_id(path: Path, *, tmp: str, mode: int) -> str:
    """The pool id in ``path``, creating it first when absent (through the fresh
    temporary name ``tmp``).

    Raises:
        PoolError: it cannot be read or created, or holds something else.
    """
    text = read_small_file(path, "pool id")
    if text is None:
        create_once(path, f"{new_pool_id()}\n".encode("ascii"), tmp=tmp, mode=mode,
                    what="pool id")
        text = read_small_file(path, "pool id")
    if text is None:
        raise PoolError(f"{path} vanished while it was being created; open the pool again",
                        path=str(path))
    if is_hex(text, 32):
        return text
    raise PoolError(
        f"{path} holds {text[:40]!r}, not a pool id (32 hex digits); "
        "the pool root may be something else",
        path=str(path),
    )


class PoolIdentity:
    """The identity of the pool at ``layout``: its id, and its probes.

    ``host`` tags temporary files; ``mode`` is the permission of the files it writes
    (the pool's read-only file mode, so every reader of the pool can read a probe).

    Raises:
        PoolError: the id cannot be read or created (see :func:`load_pool_id`).
    """

    def __init__(self, layout: PoolLayout, *, host: str, mode: int) -> None:
        self._layout = layout
        self._host = host
        self._mode = mode
        #: The id this process knows the pool by.
        self.pool_id = load_pool_id(layout.pool_id_file, mode=mode,
                                    tmp=layout.temp_path("pool_id", host))

    @contextlib.contextmanager
    def probe(self, name: str, token: str) -> Iterator[bool]:
        """Place the probe ``name`` holding ``token`` for the ``with`` block, and
        remove it when the block ends, however it ends. Yields whether it was placed:
        ``False`` when the pool cannot be written (a read-only pool proves nothing,
        and is not an error) or ``name``/``token`` are not 32 hex digits."""
        path = self._layout.probe_path(name)
        placed = False
        try:
            if is_hex(name, 32) and is_hex(token, 32):
                placed = self._place(path, token)
            yield placed
        finally:
            if placed:
                unlink_quietly(path)

    def _place(self, path: str, token: str) -> bool:
        try:
            fd = os.open(path, CREATE_FLAGS, self._mode)
        except OSError as exc:
            logger.warning("cannot place a probe in %s (%s): ranks sharing this pool are "
                           "treated as separate pools for this run", self._layout.root, exc)
            return False
        try:
            write_all(fd, token.encode("ascii"))
        except OSError as exc:
            logger.warning("cannot write the probe %s (%s)", path, exc)
            os.close(fd)
            unlink_quietly(path)
            return False
        # Closed before anyone looks: NFS shows a file to other clients on close.
        os.close(fd)
        emit("pool.probe", root=str(self._layout.root), pool_id=self.pool_id)
        return True

    def sees(self, name: str, token: str) -> bool:
        """Whether the probe ``name`` is in this pool and holds ``token`` (any error
        reading it, or a malformed name or token from a peer, is a no)."""
        if not (is_hex(name, 32) and is_hex(token, 32)):
            return False
        try:
            fd = os.open(self._layout.probe_path(name), READ_FLAGS)
        except OSError:
            return False
        try:
            return os.read(fd, 64) == token.encode("ascii")
        except OSError:
            return False
        finally:
            os.close(fd)

    def renew(self) -> str:
        """Give the pool a fresh id, because it was found to be a copy of another pool
        with the same id; return the id now recorded (read back after the replacement).
        When the file no longer holds the id this object knew (a concurrent renewal
        won), that id is adopted instead. The id is replaced only under a lock really
        held: without one, two renewals could each replace it, and one process keep an
        id the file no longer holds.

        Raises:
            PoolError: the id cannot be read or replaced (a read-only pool), another
                process held the renewal lock past the wait, or no lock can be taken
                there (file locks unsupported, a read-only pool).
        """
        lock = FileLock(self._layout.id_lock_path(), timeout=_RENEW_LOCK_TIMEOUT,
                        remove_on_release=True)
        lock.acquire()
        try:
            current = self._read()
            if current != self.pool_id:
                self.pool_id = current
                return current
            if not lock.held:
                why = ("no lock can be taken there (locks unsupported, or the pool "
                       "read-only)" if lock.degraded else
                       f"another process has held it for {_RENEW_LOCK_TIMEOUT:g}s")
                raise PoolError(f"cannot renew the id of the pool at {self._layout.root} "
                                f"without the lock {lock.path}: {why}", path=lock.path)
            self._replace(new_pool_id())
            recorded = self._read()
        finally:
            lock.release()
        logger.warning("the pool at %s is a copy of pool %s (same id, another directory): "
                       "it is pool %s from now on", self._layout.root, current, recorded)
        emit("pool.renewed", root=str(self._layout.root), old=current, new=recorded)
        self.pool_id = recorded
        return recorded

    def reload(self) -> str:
        """Read the id again (another process may have renewed it); return it.

        Raises:
            PoolError: it cannot be read, or holds something else.
        """
        self.pool_id = self._read()
        return self.pool_id

    def _read(self) -> str:
        path = self._layout.pool_id_file
        text = read_small_file(path, "pool id")
        if text is None or not is_hex(text, 32):
            raise PoolError(f"{path} holds {text!r}, not a pool id (32 hex digits); remove "
                            "it to let the pool make a new one", path=str(path))
        return text

    def _replace(self, fresh: str) -> None:
        target = self._layout.pool_id_file
        tmp = self._layout.temp_path("pool_id", self._host)
        fd = temp_file(tmp)
        try:
            write_all(fd, f"{fresh}\n".encode("ascii"))
            os.fchmod(fd, self._mode)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, target)
            fsync_dir(self._layout.root)
        except OSError as exc:
            raise pool_error("cannot record a fresh pool id in", target, exc) from exc
        finally:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
            unlink_quietly(tmp)
