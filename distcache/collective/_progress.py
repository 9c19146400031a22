"""Rank 0's progress bar for a collective prefetch: bytes its pool still needs, shown
on a terminal only (a job's log file gets the summary line, not a bar's redraws)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from distcache._log import get_logger
from distcache.collective._plan import Plan

log = get_logger(__name__)


def bytes_for_rank0(plan: Plan, sizes: list[int | None], pool_ids: list[str]) -> int | None:
    """Bytes rank 0 will download itself or receive into its pool as its writer;
    ``None`` where one of those artifacts is listed without a size (the bar counts
    the bytes it gets with no total, rather than passing 100 %)."""
    counted = list(plan.downloads.get(0, ()))
    pool = pool_ids[0]
    if plan.writers.get(pool) == 0:
        counted += [i for source, indices in plan.sends if source != 0
                    for i in indices if pool in plan.lacking[i]]
    known = [sizes[i] for i in counted]
    if any(size is None for size in known):
        return None
    return sum(size or 0 for size in known)


class Progress:
    """A thread-safe byte counter shown as a ``tqdm`` bar when ``enabled`` and stderr
    is a terminal; otherwise every call is a no-op. ``total`` ``None``: unknown, a
    count of bytes and a rate without a percentage; 0: nothing to show."""

    def __init__(self, total: int | None, *, enabled: bool,
                 desc: str = "distcache prefetch") -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        if enabled and (total is None or total > 0) and _terminal():
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=desc, leave=False, file=sys.stderr)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._drawn(lambda bar: bar.update(nbytes))

    def close(self) -> None:
        if self._bar is not None:
            with self._lock:
                self._drawn(lambda bar: bar.close())
                self._bar = None

    def _drawn(self, draw: Callable[[Any], object]) -> None:
        """``draw`` the bar (under the lock); a terminal that went away (a closed or
        hung-up stderr: EIO, EPIPE, a closed file) drops the bar, not the prefetch."""
        if self._bar is None:
            return
        try:
            draw(self._bar)
        except (OSError, ValueError) as exc:
            self._bar = None
            log.warning("progress bar dropped: stderr cannot be written (%s)", exc)


def _terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
