"""The artifact pool: a content-addressed, SHA-256-verified store on one filesystem.

:class:`ArtifactPool` is the store and :class:`Pool` the protocol its callers rely on
(declared once, here, with the :class:`Identity` a collective checks); :class:`PoolLayout` and :data:`FORMAT_VERSION`
(from :mod:`distcache.store.layout`) say where its files live and which on-disk
format it writes; :class:`GcReport`, :class:`PoolStats` and :class:`VerifyReport`
are what its maintenance calls return. File I/O, the label log, locking and
maintenance sit behind them as private modules.
"""

from __future__ import annotations

from distcache.store._pool import ArtifactPool
from distcache.store._protocol import Identity, Pool
from distcache.store._report import GcReport, PoolStats, VerifyReport
from distcache.store.layout import FORMAT_VERSION, PoolLayout

__all__ = ["FORMAT_VERSION", "ArtifactPool", "GcReport", "Identity", "Pool", "PoolLayout",
           "PoolStats", "VerifyReport"]
