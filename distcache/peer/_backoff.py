"""How long an agent that did not answer is left out: a back-off per endpoint that
doubles with each failure in a row, up to a cap, and ends at its first answer.

Once a back-off has passed, one asker asks the agent again (for as long as its ask may
take, the others still leave it out): a stopped agent costs one bound per back-off,
not one per lookup.
"""

from __future__ import annotations

import threading
import time


def _now() -> float:
    return time.monotonic()


class Backoff:
    """Endpoints left out, each until a time, and how many failures in a row put it
    there. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}
        self._failures: dict[str, int] = {}

    def down(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is left out now."""
        with self._lock:
            return self._until.get(endpoint, 0.0) > _now()

    def skip(self, endpoint: str, asking_s: float) -> bool:
        """Whether an asker leaves ``endpoint`` out now; one that may ask it (its
        back-off over) has it left out by the others for ``asking_s`` seconds, the
        time its ask may take."""
        with self._lock:
            now = _now()
            if self._until.get(endpoint, 0.0) > now:
                return True
            if endpoint in self._failures:
                self._until[endpoint] = now + asking_s
            return False

    def failed(self, endpoint: str, first: float, most: float) -> float:
        """``endpoint`` did not answer: left out for ``first`` seconds, doubled for each
        failure in a row before, at most ``most`` (and never less than ``first``);
        the seconds it is left out."""
        with self._lock:
            failures = self._failures.get(endpoint, 0) + 1
            self._failures[endpoint] = failures
            seconds = min(first * 2.0 ** min(failures - 1, 32), max(most, first))
            self._until[endpoint] = _now() + seconds
            return seconds

    def release(self, endpoint: str) -> None:
        """The asker let through by :meth:`skip` is done without a verdict (neither
        an answer nor a failure to answer): the others may ask again now."""
        with self._lock:
            if endpoint in self._failures:
                self._until.pop(endpoint, None)

    def answered(self, endpoint: str) -> bool:
        """``endpoint`` answered: no longer left out. Whether it had failed before."""
        with self._lock:
            self._until.pop(endpoint, None)
            return self._failures.pop(endpoint, None) is not None
