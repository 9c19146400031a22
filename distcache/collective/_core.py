"""The former single-module home of the collective, kept as an import path.

Import from :mod:`distcache.collective` instead; nothing is defined here.
"""

from __future__ import annotations

from distcache.collective._prefetch import prefetch as prefetch
from distcache.collective._report import PHASES as PHASES
from distcache.collective._report import PrefetchReport as PrefetchReport
from distcache.collective._sync import SyncState as SyncState
from distcache.collective._sync import sync as sync
