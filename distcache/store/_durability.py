"""Durability per batch: what an :class:`~distcache.store._objects.ObjectStore`
publishes inside :meth:`Durability.batch` is flushed once, when the outermost batch
ends (one ``syncfs``, else an ``fsync`` per file and per directory), instead of an
``fsync`` per object and directory.

An ``fsync`` per object cost more than the copy itself for a family of thousands of
small kernels. Deferring it is safe because every read of the pool is verified: a
power loss inside a batch can leave a linked object with torn bytes, which the next
read quarantines and reports as a miss.

Every :attr:`Durability.writeback_bytes` published inside a batch, a background
``syncfs`` starts writing them back, so that the disk works while the batch goes on
(hashing, receiving) and the final flush finds little left. A background flush that
fails is raised when the batch ends, like a failing final flush.

A batch may also end without waiting for its flush (``batch(wait=False)``): a
prefetch does, so that an engine's start-up never waits on a ``syncfs`` that may
also be flushing other programs' writes on the same filesystem; the objects are
published and verified when it returns, and only their survival of a power loss
in the next moments depends on that flush.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from distcache.errors import PoolError
from distcache.store._fs import fsync_dir, fsync_path, pool_error, sync_filesystem

logger = logging.getLogger(__name__)


class Durability:
    """The batches of the store whose objects live under ``root``."""

    #: Bytes published inside a batch after which a background flush starts.
    writeback_bytes: int = 64 << 20

    def __init__(self, root: str) -> None:
        self.root = root
        self._guard = threading.Lock()
        # Batches open (any thread), what their publications left to flush, and the
        # background flush with the bytes published since it last started.
        self._batches = 0
        self._unsynced: list[str] = []
        self._unflushed_bytes = 0
        self._writeback: threading.Thread | None = None
        self._error: OSError | None = None
        # Flushes of batches that did not wait, and the one thread doing them.
        self._later: list[str] = []
        self._later_writebacks: list[threading.Thread] = []
        self._flusher: threading.Thread | None = None

    @property
    def deferred(self) -> bool:
        """Whether a batch is open (publications need not be flushed one by one)."""
        with self._guard:
            return self._batches > 0

    @contextlib.contextmanager
    def batch(self, *, wait: bool = True) -> Iterator[None]:
        """Defer the durability of publications until the outermost batch ends, then
        flush them together. Nested and concurrent batches (threads of one process)
        share one flush, at the end of the last. With ``wait=False`` the outermost
        batch ends at once and its flush runs on a thread of its own (the process
        waits for it before exiting); a failure there is logged, not raised.

        Raises:
            PoolError: the flush failed (an I/O error): what was published may not
                survive a power loss.
        """
        with self._guard:
            self._batches += 1
        try:
            yield
        finally:
            with self._guard:
                self._batches -= 1
                last = self._batches == 0
                pending, writeback = (self._unsynced, self._writeback) if last else ([], None)
                if last:
                    self._unsynced, self._writeback, self._unflushed_bytes = [], None, 0
            if last and wait:
                self._finish(pending, writeback)
            elif last and pending:
                self._flush_later(pending, writeback)

    def _finish(self, pending: list[str], writeback: threading.Thread | None) -> None:
        if writeback is not None:
            writeback.join()
        with self._guard:
            early, self._error = self._error, None
        if pending:
            self.flush(pending)
        if early is not None:
            raise pool_error("cannot flush published objects under", self.root, early)

    def _flush_later(self, pending: list[str], writeback: threading.Thread | None) -> None:
        """Hand a batch's flush to the background flusher, starting it if none runs:
        one flusher at a time, however many batches end meanwhile."""
        with self._guard:
            self._later.extend(pending)
            if writeback is not None:
                self._later_writebacks.append(writeback)
            if self._flusher is not None:
                return
            self._flusher = threading.Thread(target=self._flush_in_background,
                                             name="distcache-flush")
            self._flusher.start()

    def _flush_in_background(self) -> None:
        while True:
            with self._guard:
                pending, self._later = self._later, []
                writebacks, self._later_writebacks = self._later_writebacks, []
                if not pending:
                    self._flusher = None
                    return
            for writeback in writebacks[:-1]:
                writeback.join()
            try:
                self._finish(pending, writebacks[-1] if writebacks else None)
            except PoolError as exc:
                logger.error("%s; the objects stay verified on every read, so a torn one "
                             "is fetched again, but check the disk", exc)

    def published(self, path: str, size: int) -> bool:
        """Record the publication of ``path`` (``size`` bytes) in the open batch;
        False when none is open (the caller then makes it durable itself)."""
        with self._guard:
            if self._batches == 0:
                return False
            self._unsynced.append(path)
            self._unflushed_bytes += size
            running = self._writeback is not None and self._writeback.is_alive()
            if self._unflushed_bytes < self.writeback_bytes or running:
                return True
            self._unflushed_bytes = 0
            self._writeback = threading.Thread(target=self._write_back,
                                               name="distcache-writeback", daemon=True)
            self._writeback.start()
        return True

    def _write_back(self) -> None:
        try:
            sync_filesystem(self.root)
        except OSError as exc:
            logger.warning("background flush of %s failed: %s", self.root, exc)
            with self._guard:
                self._error = self._error or exc

    def flush(self, paths: list[str]) -> None:
        """Make ``paths`` (published objects) and their directories durable.

        Raises:
            PoolError: the flush failed.
        """
        try:
            if sync_filesystem(self.root):
                return
            directories = set()
            for path in paths:
                with contextlib.suppress(FileNotFoundError):  # collected meanwhile
                    fsync_path(path)
                directories.add(os.path.dirname(path))
            for directory in sorted(directories):
                fsync_dir(directory)
        except OSError as exc:
            raise pool_error("cannot flush published objects under", self.root, exc) from exc
