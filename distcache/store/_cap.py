"""A pool's size cap: when this process measures the pool, and when it collects.

Every process that writes a pool keeps its own running figure of the pool's size (a
scan, then its own publications added), and processes share nothing but the files; so
each one measures the pool again (the scan a collection makes) once it has published
:data:`RESCAN_FRACTION` of the cap since its last measurement. That bounds the
overshoot of a pool shared by several processes (:class:`Cap`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.store import _maintenance
from distcache.store._quarantine import trim_quarantine

if TYPE_CHECKING:
    from distcache.store._objects import ObjectStore
    from distcache.store._report import GcReport

logger = get_logger(__name__)

#: A process measures the pool again once it has published this part of the cap
#: since its last measurement.
RESCAN_FRACTION = 1 / 16


class Cap:
    """A pool's size cap (``max_bytes``; ``None``: none). Past it, the least recently
    used objects are collected: after a publication outside any batch, and once when
    the last open batch (:meth:`batch`, any thread) ends, not after each of its
    objects (each collection scans the whole pool). What was just published, and what
    a batch holds (:meth:`held`), is never collected by that collection: an object
    larger than the cap stays until a later one, and an import or a prefetch of more
    than the cap keeps its whole set, over the cap, and says so.

    The pool's size is measured (a scan) on the first publication, then followed by
    adding this process's publications; other processes' publications are seen at
    the next measurement, which a collection makes. A process collects (measuring
    first) once its figure passes the cap, or once it has published
    :data:`RESCAN_FRACTION` of the cap since its last measurement. So ``N`` processes
    publishing into one pool at once take it past its cap by at most
    ``N * (max_bytes / 16 + the largest object one of them publishes)`` outside their
    batches; an uncapped pool is never measured, and a pool well under its cap is
    measured once per sixteenth of the cap published."""

    def __init__(self, store: ObjectStore, max_bytes: int | None) -> None:
        self.store = store
        self.layout = store.layout
        self.max_bytes = max_bytes
        self._guard = threading.Lock()
        self._approx: int | None = None
        self._unmeasured = 0  # bytes this process published since the last measurement
        self._open = 0
        self._fresh: dict[str, int] = {}
        self._due = False

    def set_total(self, size: int) -> None:
        """The pool holds ``size`` bytes (a scan or a collection found so)."""
        with self._guard:
            self._approx = size
            self._unmeasured = 0

    def published(self, sha: str, size: int) -> None:
        """``size`` bytes were published as ``sha``: collect if the pool is past its
        cap, or measure it again (by collecting) once this process published its
        share of the cap since the last measurement (when the last batch ends, if one
        is open)."""
        if self.max_bytes is None:
            return
        with self._guard:
            if self._approx is not None:
                self._approx += size
                self._unmeasured += size
            current = self._approx
            if self._open:
                self._fresh[sha] = size
        if current is None:
            current = sum(st.st_size for _path, _sha, st in self.store.scan())
            self.set_total(current)
        with self._guard:
            # Divided, not multiplied: a cap past a float's range (10**400) is no cap.
            stale = self._unmeasured / RESCAN_FRACTION >= self.max_bytes
            if current <= self.max_bytes and not stale:
                return
            if self._open:
                self._due = True
                return
        self.collect(keep=(sha,))

    def held(self, sha: str, size: int) -> None:
        """``sha`` (``size`` bytes), found in the pool, is part of what an open batch
        brings: its end collects around it, as around what the batch published."""
        if self.max_bytes is None:
            return
        with self._guard:
            if self._open:
                self._fresh[sha] = size

    @property
    def holding(self) -> bool:
        """Whether :meth:`held` keeps anything now: a cap and an open batch."""
        return self.max_bytes is not None and self._open > 0

    def collect(self, max_bytes: int | None = None, keep: Collection[str] = ()) -> GcReport:
        """:func:`~distcache.store._maintenance.gc` down to ``max_bytes`` (default: the
        cap), keeping ``keep``; the pool's size it finds is the new measurement. Then
        ``quarantine/`` is trimmed to the store's ``quarantine_keep`` newest entries."""
        report = _maintenance.gc(self.layout, self.max_bytes if max_bytes is None else max_bytes,
                                 keep)
        trim_quarantine(self.layout, self.store.quarantine_keep)
        self.set_total(report.kept_bytes)
        return report

    @contextlib.contextmanager
    def batch(self, inner: AbstractContextManager[None]) -> Iterator[None]:
        """``inner`` (the store's durability batch), with collection held until the
        last open batch ends."""
        with self._guard:
            self._open += 1
        try:
            with inner:
                yield
        finally:
            with self._guard:
                self._open -= 1
                last = self._open == 0
                fresh, due = (self._fresh, self._due) if last else ({}, False)
                if last:
                    self._fresh, self._due = {}, False
            if due:
                report = self.collect(keep=fresh)
                if self.max_bytes is not None and report.kept_bytes > self.max_bytes:
                    logger.warning(
                        "pool %s holds %d bytes, more than its cap of %d: the %d objects "
                        "(%d bytes) just published are kept whole; later collections "
                        "remove them as they age", self.layout.root, report.kept_bytes,
                        self.max_bytes, len(fresh), sum(fresh.values()))
