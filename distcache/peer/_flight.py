"""Singleflight: concurrent calls for one key share one execution of the work."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

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
    A later call, after the first finished, runs ``work`` anew."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, _Call[T]] = {}
        #: Calls that ran the work, and calls that waited on another's.
        self.led = 0
        self.joined = 0

    def do(self, key: str, work: Callable[[], T], *, timeout: float | None = None) -> T:
        """Raises:
            StillRunning: this caller waited on another's call longer than ``timeout``
                (that call goes on); a :class:`TimeoutError`.
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
            try:
                call.value = work()
            except BaseException as exc:
                call.error = exc
            finally:
                with self._lock:
                    del self._calls[key]
                call.done.set()
        elif not call.done.wait(timeout):
            raise StillRunning(f"waited {timeout} s for another caller's work on {key}")
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]
