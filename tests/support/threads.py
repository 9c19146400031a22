"""Running a collective body on every rank of an in-process thread group, and the
stand-ins such tests share: an integration that wants a list, thread-ranks presented
as separate processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distcache.artifact import Artifact
from distcache.comm import Communicator, CountingCommunicator, ThreadGroup


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


class Wanting:
    """An integration that wants ``wanted`` (its usage record, as FlashInfer's)."""

    name = "wanting"

    def __init__(self, wanted: list[Artifact]) -> None:
        self.wanted = wanted

    def available(self) -> bool:
        return True

    def default_origin(self) -> str | None:
        return None

    def manifest(self) -> list[Artifact]:
        return list(self.wanted)

    def install(self, pool: object, origin: object) -> None:
        pass

    def uninstall(self) -> None:
        pass

    def materialize_dir(self) -> Path | None:
        return None


class AsProcesses(CountingCommunicator):
    """Thread-ranks that present themselves as ranks of separate processes: their node
    tree is made by a collective, and node leaders may act for their nodes."""

    @property
    def backend(self) -> str:
        return "gloo"
