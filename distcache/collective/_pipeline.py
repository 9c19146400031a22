"""The threads that overlap a move's disk work with its transfers
(:mod:`distcache.collective._stream`): a receiver publishes each bucket while the next
one arrives (:class:`Publisher`), and a source builds its next bucket while the current
one travels (:class:`ReadAhead`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

from distcache.collective._bucket import StreamStats
from distcache.store import Pool


class Publisher:
    """Publishes received buckets on a thread of its own, one bucket behind the
    protocol, so that hashing and writing one bucket overlap the transfer of the next
    (hashing and file writes release the GIL). At most one bucket waits in the queue:
    memory stays a few buckets.

    :attr:`failed` holds the ``(object index, error)`` of each object it could not
    publish; after the first it publishes nothing more (the move fails anyway). What
    the source side of the same rank fails to read is not its concern: the buckets it
    receives from the other sources are published whatever this rank sends."""

    def __init__(self, pool: Pool, objects: Sequence[str], stats: StreamStats,
                 on_done: Callable[[int], None] | None) -> None:
        self._pool = pool
        self._on_done = on_done
        self._objects = objects
        self._stats = stats
        #: This rank's receive-side failures (read once :meth:`close` returned).
        self.failed: list[tuple[int, BaseException]] = []
        self._queue: queue.Queue[tuple[list[tuple[int, memoryview]], int] | None] = (
            queue.Queue(1))
        # Bytes of received buckets not yet published (their views keep them alive).
        self._held = 0
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="distcache-publish",
                                        daemon=True)
        self._thread.start()

    def arrived(self, nbytes: int) -> None:
        """A bucket of ``nbytes`` was received: held until :meth:`submit` lets it go."""
        with self._guard:
            self._held += nbytes
            self._stats.hold(self._held)

    def submit(self, entries: list[tuple[int, memoryview]], nbytes: int) -> None:
        """Publish ``entries``, views into the bucket of ``nbytes`` that arrived."""
        if entries:
            self._queue.put((entries, nbytes))
        else:
            self._release(nbytes)

    def _release(self, nbytes: int) -> None:
        with self._guard:
            self._held -= nbytes

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            entries, nbytes = item
            for index, view in entries:
                if self.failed:
                    break
                try:
                    self._pool.put(view, self._objects[index])
                    self._stats.published += 1
                    if self._on_done is not None:
                        self._on_done(len(view))
                except Exception as exc:
                    self.failed.append((index, exc))
            del entries, item
            self._release(nbytes)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class ReadAhead:
    """A source's bucket messages, each built on a thread of its own while the one
    before is broadcast and the peers' buckets arrive, so that reading from the pool
    and filling the next message overlap the transfer instead of holding the peers
    idle. At most one message waits, built, beside the one being sent."""

    def __init__(self, messages: Iterator[bytearray]) -> None:
        self._messages = messages
        self._queue: queue.Queue[tuple[bytearray | None, BaseException | None]] = queue.Queue(1)
        self._stop = threading.Event()
        # Released when the protocol takes a message: one is built ahead, no more.
        self._taken = threading.Semaphore(1)
        self._thread = threading.Thread(target=self._run, name="distcache-read-ahead",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self._turn():  # the message before was taken: build the next
                message = next(self._messages, None)
                if message is None or not self._offer((message, None)):
                    return
                del message
        except BaseException as exc:  # handed to the protocol's thread, raised there
            self._offer((None, exc))

    def _turn(self) -> bool:
        while not self._stop.is_set():
            if self._taken.acquire(timeout=0.1):
                return True
        return False

    def _offer(self, item: tuple[bytearray | None, BaseException | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> bytearray:
        message, exc = self._queue.get()
        self._taken.release()
        if exc is not None:
            raise exc
        assert message is not None
        return message

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
