"""Running a collective body on every rank of an in-process thread group."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from distcache.comm import Communicator, ThreadGroup


def run_ranks(group: ThreadGroup, body: Callable[[Communicator], Any],
              limit: float = 60.0) -> list[Any]:
    """``body(comm)`` on every thread-rank, each result or raised exception; fails
    the test when a rank is still running after ``limit`` seconds."""
    results: list[Any] = [None] * group.size

    def one(rank: int) -> None:
        try:
            results[rank] = body(group.comm(rank))
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(group.size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread-rank hung"
    return results
