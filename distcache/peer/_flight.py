"""Singleflight: concurrent calls for one key share one execution of the work."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from distcache.artifact import Artifact

T = TypeVar("T")


class StillRunning(TimeoutError):
    """A caller stopped waiting for another caller's work, which goes on."""


class _Call(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


class Singleflight(Generic[T]):
    """``do(key, work)``: the first caller for ``key`` runs ``work``; callers that come
    while it runs wait for its result (or its exception) instead of running it again.
    A later call, after the first finished, runs ``work`` anew. With ``bounded``, the
    first caller too waits at most ``timeout``: the work runs on a thread of its own and
    goes on when the caller stops waiting (an agent leading an origin download answers
    its asker within the asker's budget, as one waiting on it does)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, _Call[T]] = {}
        #: Calls that ran the work, and calls that waited on another's.
        self.led = 0
        self.joined = 0

    def running(self, key: str) -> bool:
        """Whether a call for ``key`` runs now (a :meth:`do` would wait on it)."""
        with self._lock:
            return key in self._calls

    def do(self, key: str, work: Callable[[], T], *, timeout: float | None = None,
           bounded: bool = False) -> T:
        """Raises:
            StillRunning: this caller waited on the call longer than ``timeout`` (the
                call goes on); a :class:`TimeoutError`.
            what ``work`` raised, in every caller that shared the call.
        """
        with self._lock:
            call = self._calls.get(key)
            leader = call is None
            if call is None:
                call = self._calls[key] = _Call()
                self.led += 1
            else:
                self.joined += 1
        if leader:
            def run() -> None:
                try:
                    call.value = work()
                except BaseException as exc:
                    call.error = exc
                finally:
                    with self._lock:
                        del self._calls[key]
                    call.done.set()

            if timeout is None or not bounded:
                run()
            else:
                threading.Thread(target=run, daemon=True, name="distcache-flight").start()
        if not call.done.wait(timeout):
            raise StillRunning(f"waited {timeout} s for the work on {key}, which goes on")
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]


def flight_key(artifact: Artifact) -> str:
    """What concurrent requests share one walk or one origin download by: the name as
    well as the bytes, since the origin is asked by name (the same bytes under a name
    it lacks must not answer 'not at origin' for a name it has)."""
    return f"{artifact.name}@{artifact.sha256}"
