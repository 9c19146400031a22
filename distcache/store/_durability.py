"""Durability per batch: what an :class:`~distcache.store._objects.ObjectStore`
publishes inside :meth:`Durability.batch` is flushed once, when the outermost batch
ends (one ``syncfs``, else an ``fsync`` per file and per directory), instead of an
``fsync`` per object and directory.

An ``fsync`` per object cost more than the copy itself for a family of thousands of
small kernels. Deferring it is safe because every read of the pool is verified: a
power loss inside a batch can leave a linked object with torn bytes, which the next
read quarantines and reports as a miss.

The entry of a new fan-out directory ``objects/<xx>`` is the batch's too: a batch
makes the directory without flushing ``objects/``, and its flush covers it (the
``syncfs``, else an ``fsync`` of ``objects/`` after the directories). Outside a batch
``objects/`` is flushed once the directory is made, before anything is published in
it, and after every publication into a directory that was already there: another
process's batch may have made it and not flushed yet
(:meth:`~distcache.store._objects.ObjectStore.publish`).

Every :attr:`Durability.writeback_bytes` published inside a batch, a background
``syncfs`` starts writing them back, so that the disk works while the batch goes on
(hashing, receiving) and the final flush finds little left. Each writeback keeps its
own error, handed to whoever finishes that batch's flush: a failed writeback fails
the flush of the batch it belonged to, and no other.

A batch may also end without waiting for its flush (``batch(wait=False)``): a
prefetch and a sync do, so that an engine's start-up or serving loop never waits on a
``syncfs`` that may also be flushing other programs' writes on the same filesystem;
the objects are published and verified when they return, and only their survival of
a power loss in the next moments depends on that flush. It runs on one non-daemon
thread per store, so the process waits for it before exiting; its failure is logged
at ERROR, not raised. It holds off :attr:`Durability.flush_delay` seconds first: an
engine loads the kernels a start-up published right after it, and a ``syncfs`` then
took the CPU and the disk those loads wait for; the process's exit (its main thread
ending) cuts the wait short. A batch nested in another of the same thread takes that one's
``wait``. When batches of several threads overlap, the last to end flushes for all
of them, and waits if any of them asked to.

A child forked while a batch or a flush runs starts with none: its parent flushes
what it published.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator

from distcache._log import get_logger
from distcache.errors import PoolError
from distcache.store._fs import fsync_dir, fsync_path, pool_error, sync_filesystem

logger = get_logger(__name__)


class _Writeback(threading.Thread):
    """A background ``syncfs`` of ``root`` that keeps its own error."""

    def __init__(self, root: str) -> None:
        super().__init__(name="distcache-writeback", daemon=True)
        self.root = root
        self.error: OSError | None = None

    def run(self) -> None:
        try:
            sync_filesystem(self.root)
        except OSError as exc:
            logger.warning("background flush of %s failed: %s", self.root, exc)
            self.error = exc


class Durability:
    """The batches of the store whose objects live under ``root``."""

    #: Bytes published inside a batch after which a background flush starts.
    writeback_bytes: int = 64 << 20
    #: Seconds the flush of a batch that did not wait holds off before it starts.
    flush_delay: float = 2.0

    def __init__(self, root: str) -> None:
        self.root = root
        self._reset()
        _live.add(self)

    def _reset(self) -> None:
        """No batch open and nothing pending (at creation, and in a forked child)."""
        self._guard = threading.Lock()
        # Per thread: the wait of the batch it has open (a nested one inherits it).
        self._local = threading.local()
        # Batches open (any thread), whether one of them asked to wait, what their
        # publications left to flush, their writebacks (the last one may run) and
        # the bytes published since it started.
        self._batches = 0
        self._wait = False
        self._unsynced: list[str] = []
        self._writebacks: list[_Writeback] = []
        self._unflushed_bytes = 0
        # Flushes of batches that did not wait, and the one thread doing them.
        self._later: list[str] = []
        self._later_writebacks: list[_Writeback] = []
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
        share one flush, at the end of the last, which waits for it if any of them
        asked to; a batch nested in one of the same thread takes that one's ``wait``.
        With ``wait=False`` (and no other thread's batch that waits) the
        outermost batch ends at once and its flush runs on a thread of its own (the
        process waits for it before exiting); a failure there is logged, not raised.

        Raises:
            PoolError: the flush failed (an I/O error): what was published may not
                survive a power loss.
        """
        outer: bool | None = getattr(self._local, "wait", None)
        if outer is not None:
            wait = outer
        self._local.wait = wait
        with self._guard:
            self._batches += 1
            self._wait = self._wait or wait
        try:
            yield
        finally:
            self._local.wait = outer
            with self._guard:
                self._batches -= 1
                last = self._batches == 0
                if last:
                    pending, writebacks, waits = self._unsynced, self._writebacks, self._wait
                    self._unsynced, self._writebacks = [], []
                    self._unflushed_bytes, self._wait = 0, False
            if last and waits:
                self._finish(pending, writebacks)
            elif last and pending:
                self._flush_later(pending, writebacks)

    def _finish(self, pending: list[str], writebacks: list[_Writeback]) -> None:
        for writeback in writebacks:
            writeback.join()
        early = next((w.error for w in writebacks if w.error is not None), None)
        if pending:
            self.flush(pending)
        if early is not None:
            raise pool_error("cannot flush published objects under", self.root, early)

    def _flush_later(self, pending: list[str], writebacks: list[_Writeback]) -> None:
        """Hand a batch's flush to the background flusher, starting it if none runs:
        one flusher at a time, however many batches end meanwhile."""
        with self._guard:
            self._later.extend(pending)
            self._later_writebacks.extend(writebacks)
            if self._flusher is not None:
                return
            flusher = threading.Thread(target=self._flush_in_background,
                                       name="distcache-flush")
            flusher.start()  # raises (no thread left) before it is taken as running
            self._flusher = flusher

    def _flush_in_background(self) -> None:
        try:
            _hold_off(self.flush_delay)
            while True:
                with self._guard:
                    pending, self._later = self._later, []
                    writebacks, self._later_writebacks = self._later_writebacks, []
                    if not pending:
                        self._flusher = None
                        return
                try:
                    self._finish(pending, writebacks)
                except PoolError as exc:
                    logger.error("%s; the objects stay verified on every read, so a torn "
                                 "one is fetched again, but check the disk", exc)
        except BaseException:
            # Not a flush failure: a defect. Say so, and let the next batch start a
            # flusher again rather than hand its flush to one that is gone.
            logger.exception("the background flush of %s stopped", self.root)
            with self._guard:
                self._flusher = None
            raise

    def published(self, path: str, size: int) -> bool:
        """Record the publication of ``path`` (``size`` bytes) in the open batch;
        False when none is open (the caller then makes it durable itself)."""
        with self._guard:
            if self._batches == 0:
                return False
            self._unsynced.append(path)
            self._unflushed_bytes += size
            running = bool(self._writebacks) and self._writebacks[-1].is_alive()
            if self._unflushed_bytes < self.writeback_bytes or running:
                return True
            self._unflushed_bytes = 0
            writeback = _Writeback(self.root)
            writeback.start()
            self._writebacks.append(writeback)
        return True

    def settle(self, path: str, size: int, *, deferred: bool, made: bool) -> None:
        """Make the publication of ``path`` (linked, ``size`` bytes) durable, or leave
        it to the open batch: ``deferred`` when a batch was open as it began (which
        may have ended since); ``made`` when it made its fan-out directory and
        flushed ``objects/`` then (:func:`~distcache.store._fs.make_fanout`).

        Raises:
            PoolError: a flush failed.
        """
        if self.published(path, size):
            return
        if deferred:  # the batch ended while it was being written: flush it now
            self.flush([path])
            return
        directory = os.path.dirname(path)
        fsync_dir(directory)
        if not made:  # perhaps another process's batch made it, unflushed
            fsync_dir(os.path.dirname(directory))

    def flush(self, paths: list[str]) -> None:
        """Make ``paths`` (published objects), their directories and those
        directories' entries in ``objects/`` durable (a batch makes fan-out
        directories without flushing ``objects/``).

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
            parents = {os.path.dirname(directory) for directory in directories}
            for directory in [*sorted(directories), *sorted(parents)]:
                fsync_dir(directory)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and not os.path.lexists(self.root):
                # The pool was removed meanwhile (a finished job's scratch pool, an
                # operator's rm -rf): nothing of it is left to make durable.
                logger.debug("%s is gone: nothing to flush", self.root)
                return
            raise pool_error("cannot flush published objects under", self.root, exc) from exc


def _hold_off(seconds: float) -> None:
    """Sleep ``seconds``, or until the main thread has ended (the process exits)."""
    deadline = time.monotonic() + seconds
    main = threading.main_thread()
    while main.is_alive() and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.05, left))


#: Every store's durability in this process, reset in a forked child (its threads
#: and open batches stayed in the parent, which flushes what it published).
_live: weakref.WeakSet[Durability] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for durability in list(_live):
        durability._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)
