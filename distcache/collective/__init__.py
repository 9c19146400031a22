"""The collective prefetch and sync: agree -> plan -> download -> move -> publish.

Every rank calls :func:`prefetch` (or :func:`sync`) with the same arguments; each
missing artifact is fetched from the origin by exactly one rank and its bytes move
over the communicator to the pools that lack it.
"""

from __future__ import annotations

from distcache.collective._core import PHASES, PrefetchReport, SyncState, prefetch, sync

__all__ = ["PHASES", "PrefetchReport", "SyncState", "prefetch", "sync"]
