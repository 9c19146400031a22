"""Streaming while downloading: a source sends each of its downloads as soon as it is
published, instead of after the last download of the job (plans made with
``pipelined=True``, see :mod:`distcache.collective._plan`).

The downloads run on threads (:func:`distcache.collective._download.download_objects`)
and report each finished artifact to :class:`Arrivals`; on its turn, the source sends
one bucket of what has arrived (:func:`ready_messages`), waiting only when nothing
has. The bucket table names its indices, so receivers need no agreed order. A
download that failed travels as a missing entry (length -1), exactly like an object
the source could not read, so every rank keeps taking the same turns; the failure
itself is agreed after the move. When the downloads end, by finishing or by running
out of their time budget, :meth:`Arrivals.close` turns every index still expected into
a missing entry: a source never waits longer than its downloads' budget, which is
shorter than its peers' timeout.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from distcache.collective._stream import StreamStats, message_of

#: ``(object index, bytes or None)``; None: a missing entry.
Item = tuple[int, bytes | None]


class Arrivals:
    """The object indices this rank downloads, as their downloads finish."""

    def __init__(self, indices: Iterable[int]) -> None:
        self._cond = threading.Condition()
        self._expected = set(indices)
        self._mine = frozenset(self._expected)
        self._done: deque[tuple[int, bool]] = deque()
        self._closed = False

    def owns(self, index: int) -> bool:
        """Whether ``index`` is one of this rank's downloads (reported by
        :meth:`take` exactly once, finished or not)."""
        return index in self._mine

    def finished(self, index: int, ok: bool) -> None:
        """The download of ``index`` ended: ``ok`` when the pool holds it."""
        with self._cond:
            if index in self._expected and not self._closed:
                self._expected.discard(index)
                self._done.append((index, ok))
                self._cond.notify_all()

    def close(self) -> None:
        """The downloads are over: whatever is still expected will not arrive."""
        with self._cond:
            self._closed = True
            self._done.extend((i, False) for i in sorted(self._expected))
            self._expected.clear()
            self._cond.notify_all()

    def take(self, wait: bool) -> list[tuple[int, bool]]:
        """What finished since the last call; with ``wait``, block until something
        has (or nothing more can)."""
        with self._cond:
            while wait and not self._done and not self._closed:
                self._cond.wait()
            taken = list(self._done)
            self._done.clear()
            return taken

    @property
    def over(self) -> bool:
        with self._cond:
            return self._closed and not self._done


def ready_messages(
    indices: tuple[int, ...],
    read: Callable[[int], bytes | None],
    *,
    arrivals: Arrivals,
    bucket_bytes: int,
    stats: StreamStats,
) -> Iterator[bytes]:
    """One source's bucket messages, one per ``next``: what is ready now, up to about
    ``bucket_bytes`` (an artifact larger than that alone), at least one entry while
    any is left, the last message flagged.

    ``indices`` that ``arrivals`` does not own are in the pool already and go first;
    the others go as their downloads finish, a failed download as a missing entry.
    ``read(index)`` reads an object back from the pool (None: it could not, which it
    records). Memory: one bucket plus the artifact that did not fit.
    """
    wanted = set(indices)
    ready: deque[int] = deque(i for i in indices if not arrivals.owns(i))
    missing: deque[int] = deque()
    waiting = len(wanted) - len(ready)
    carried: Item | None = None
    while True:
        for index, ok in arrivals.take(wait=not (ready or missing or carried) and waiting > 0):
            if index in wanted:
                waiting -= 1
                (ready if ok else missing).append(index)
        parts: list[Item] = []
        held = 0
        if carried is not None:
            parts.append(carried)
            held = len(carried[1] or b"")
            carried = None
        while missing:
            parts.append((missing.popleft(), None))
        while ready:
            index = ready.popleft()
            data = read(index)
            size = 0 if data is None else len(data)
            stats.hold(held + size)
            if parts and held + size > bucket_bytes:
                carried = (index, data)
                break
            parts.append((index, data))
            held += size
            del data
        last = carried is None and not ready and not missing and waiting <= 0
        yield message_of(parts, stats, last=last)
        if last:
            return
