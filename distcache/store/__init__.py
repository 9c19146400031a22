"""The artifact pool: a content-addressed, SHA-256-verified store on one filesystem.

:class:`ArtifactPool` is the store and :class:`Pool` the protocol its callers rely on
(declared once, here, with the :class:`Identity` a collective checks); :class:`PoolLayout` and :data:`FORMAT_VERSION`
(from :mod:`distcache.store.layout`) say where its files live and which on-disk
format it writes; :class:`GcReport`, :class:`PoolStats` and :class:`VerifyReport`
are what its maintenance calls return. File I/O, the label log, locking and
maintenance sit behind them as private modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distcache.store._pool import ArtifactPool
from distcache.store._protocol import Identity, Pool
from distcache.store.layout import FORMAT_VERSION, PoolLayout

if TYPE_CHECKING:
    from distcache.store._report import GcReport, PoolStats, VerifyReport

__all__ = ["FORMAT_VERSION", "ArtifactPool", "GcReport", "Identity", "Pool", "PoolLayout",
           "PoolStats", "VerifyReport"]


def __getattr__(name: str) -> Any:
    # The maintenance reports load with the first maintenance call, not with the pool
    # every rank opens at start-up.
    if name in ("GcReport", "PoolStats", "VerifyReport"):
        from distcache.store import _report

        return getattr(_report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
