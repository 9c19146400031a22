"""What the pool's maintenance calls return: plain frozen records, safe to log,
pickle and compare."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class GcReport:
    """Result of :meth:`ArtifactPool.gc`."""

    #: The cap collected down to, or ``None`` when there is no cap (nothing removed).
    max_bytes: int | None
    #: Objects removed, least recently used first.
    removed: int
    #: Bytes those objects held.
    freed_bytes: int
    #: Objects left.
    kept: int
    #: Bytes left.
    kept_bytes: int


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Result of :meth:`ArtifactPool.verify` (a full scan that hashes every object)."""

    #: Objects whose bytes match their name.
    ok: int
    #: Objects found corrupt by this scan (moved to ``quarantine/`` where they could be).
    corrupt: int
    #: Files in ``quarantine/`` after the scan, from this scan and earlier ones.
    quarantined: int
    #: Bytes in the objects found good.
    ok_bytes: int
    #: Of ``corrupt``, the objects this scan moved to ``quarantine/``; the others could
    #: not be moved (a read-only pool) and are still in place, read as misses.
    moved: int = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Result of :meth:`ArtifactPool.stats` (a directory scan, no hashing)."""

    root: Path
    pool_id: str
    #: Objects present.
    objects: int
    #: Bytes in those objects.
    bytes: int
    #: Files in ``quarantine/``.
    quarantined: int
    #: Temporary files in ``tmp/`` (downloads or publications in progress, or leftovers).
    tmp_files: int
    #: Names recorded in the name index whose objects are present.
    names: int
    #: The size cap, or ``None``.
    max_bytes: int | None
