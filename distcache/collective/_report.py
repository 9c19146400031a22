"""What one collective did: :class:`PrefetchReport`, identical on every rank."""

from __future__ import annotations

from collections.abc import Mapping

from distcache._record import Record

#: The collective's phases, in order (see :mod:`distcache.collective`).
PHASES = ("agree", "discover", "plan", "fetch", "move", "publish")


class PrefetchReport(Record):
    """What one collective did, identical on every rank.

    Counts are over *objects* (distinct sha256s; two names with the same bytes are
    one object). ``pool_hits`` counts objects every pool already held before the call
    (no download and no movement were needed for them). ``objects_published`` counts
    ``(pool, object)`` publications: an object new to 4 pools counts 4 (one that another
    job published into a pool after this call looked counts too: the pool keeps one).
    ``broadcast_bytes`` counts each bucket once, however many ranks received it.
    ``received_bytes`` counts the artifact bytes that reached pool writers over the
    communicator, once per receiving writer (an object sent to 3 pools counts 3
    times); bytes move only within an object's audience (its source and the pools that
    lack it, see :mod:`distcache.collective._audience`), so this is what the pools needed.
    ``discarded_bytes`` is the part of it that reached a pool already holding the
    object and was thrown away: zero unless a call had more distinct audiences than
    :data:`distcache.collective._audience.MAX_AUDIENCES`.
    ``seconds`` is per phase, the maximum over ranks. ``left_out`` names the artifacts
    that only a usage record listed and the start-up prefetch left out (the origin
    lacked them, or no pool held them where nothing may be downloaded), in the order
    they were left out; a collective's own report leaves it empty.
    """

    _FIELDS = ("operation", "artifacts", "objects", "downloads", "origin_bytes",
                 "broadcasts", "broadcast_bytes", "received_bytes", "discarded_bytes",
                 "pool_hits", "objects_published", "pools", "writers", "downloaders",
                 "peak_bytes", "seconds", "left_out")
    __slots__ = _FIELDS
    operation: str
    artifacts: int
    objects: int
    downloads: int
    origin_bytes: int
    broadcasts: int
    broadcast_bytes: int
    received_bytes: int
    discarded_bytes: int
    pool_hits: int
    objects_published: int
    pools: int
    writers: tuple[int, ...]
    #: Ranks that downloaded at least one object.
    downloaders: tuple[int, ...]
    #: Largest number of artifact bytes any rank held at once while moving them.
    peak_bytes: int
    seconds: Mapping[str, float]
    left_out: tuple[str, ...]

    def __init__(self, operation: str, artifacts: int, objects: int, downloads: int,
                 origin_bytes: int, broadcasts: int, broadcast_bytes: int,
                 received_bytes: int, discarded_bytes: int, pool_hits: int,
                 objects_published: int, pools: int, writers: tuple[int, ...],
                 downloaders: tuple[int, ...], peak_bytes: int,
                 seconds: Mapping[str, float] | None = None,
                 left_out: tuple[str, ...] = ()) -> None:
        self._assign(operation, artifacts, objects, downloads, origin_bytes, broadcasts,
                     broadcast_bytes, received_bytes, discarded_bytes, pool_hits,
                     objects_published, pools, writers, downloaders, peak_bytes,
                     {} if seconds is None else seconds, left_out)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def summary(self) -> str:
        """A short human-readable account (two lines)."""
        phases = " ".join(f"{p} {self.seconds.get(p, 0.0):.3f}" for p in PHASES)
        left = f", {len(self.left_out)} recorded artifact(s) left out" if self.left_out else ""
        return (
            f"{self.operation}: {self.artifacts} artifacts ({self.objects} objects, "
            f"{self.pool_hits} already everywhere) over {self.pools} pool(s); "
            f"{self.downloads} downloads ({_mb(self.origin_bytes)}) by "
            f"{len(self.downloaders)} rank(s); {self.broadcasts} broadcasts "
            f"({_mb(self.broadcast_bytes)}, {_mb(self.received_bytes)} received); "
            f"{self.objects_published} published{left}\n"
            f"  seconds: {phases} (total {self.total_seconds:.3f})"
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
