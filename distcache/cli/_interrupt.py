"""The worker pool of a command's downloads, on daemon threads, that an interrupt
(Ctrl-C) stops at once with a :class:`~distcache.origins.Stopper`: an interrupted
command never waits for a running download nor for its queue.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

def run_threads(
    fn: Callable[[T], R], items: Sequence[T], jobs: int, *, threads: list[threading.Thread]
) -> Iterator[tuple[T, R | None, BaseException | None]]:
    """``fn(item)`` for each of ``items`` on ``jobs`` daemon threads (appended to
    ``threads``), yielding ``(item, result, None)`` or ``(item, None, error)`` as each
    finishes. Daemon threads never hold up the exit of an interrupted command; when
    the caller stops iterating, the threads take no new item."""
    todo: queue.SimpleQueue[T] = queue.SimpleQueue()
    for item in items:
        todo.put(item)
    done: queue.SimpleQueue[tuple[T, R | None, BaseException | None]] = queue.SimpleQueue()
    closed = threading.Event()

    def work() -> None:
        while not closed.is_set():
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((item, fn(item), None))
            except BaseException as exc:  # handed to the caller, which decides
                done.put((item, None, exc))

    for i in range(max(1, min(jobs, len(items)))):
        thread = threading.Thread(target=work, name=f"distcache-fetch-{i}", daemon=True)
        threads.append(thread)
        thread.start()
    try:
        for _ in items:
            yield done.get()
    finally:
        closed.set()

