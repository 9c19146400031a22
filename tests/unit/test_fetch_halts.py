"""A rank whose origin or pool fails (not one artifact) ends every rank's downloads at
the next heartbeat: the prefetch fails on every rank then, not after the other ranks
have fetched their whole share. A failure of one artifact still lets the others
finish, so the next job fetches only what failed."""

from __future__ import annotations

import time
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.collective import prefetch
from distcache.comm import ThreadGroup
from distcache.errors import ArtifactNotFound, OriginUnreachable, PrefetchError
from tests.unit.test_prefetch import FakeOrigin, FakePool, Store, make_blobs, ok, run_ranks

pytestmark = pytest.mark.timeout(120)

#: Seconds each of rank 0's downloads takes: its share of 40 takes about 5 s whole.
SLOW_S = 0.25


class Slow(FakeOrigin):
    """Each request takes ``seconds``."""

    def __init__(self, blobs: dict[str, bytes], seconds: float = SLOW_S) -> None:
        super().__init__(blobs)
        self.seconds = seconds

    def fetch(self, artifact: Artifact) -> bytes:
        time.sleep(self.seconds)
        return super().fetch(artifact)


class Failing(FakeOrigin):
    """Counts each request, then fails it with ``error(artifact)``, or serves it where
    that is None."""

    def __init__(self, blobs: dict[str, bytes], error: Any) -> None:
        super().__init__(blobs)
        self.error = error

    def fetch(self, artifact: Artifact) -> bytes:
        data = super().fetch(artifact)
        exc = self.error(artifact)
        if exc is not None:
            raise exc
        return data


def _two_ranks(rank1: FakeOrigin, slow_s: float = SLOW_S
               ) -> tuple[list[Any], Slow, list[Artifact], list[Store]]:
    arts, blobs = make_blobs(40)
    stores = [Store("p0"), Store("p1")]
    pools = [FakePool(s) for s in stores]
    origins: list[FakeOrigin] = [Slow(blobs, slow_s), rank1]
    rank1.blobs = blobs
    group = ThreadGroup(2, ["a", "b"], timeout=20)
    out = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                              origin=origins[r], downloads_per_rank=1,
                                              timeout=20), join=90)
    return out, origins[0], arts, stores  # type: ignore[return-value]


def test_an_origin_unreachable_from_one_rank_ends_the_other_ranks_downloads() -> None:
    down = Failing({}, lambda a: OriginUnreachable(
        f"cannot connect to fake://origin for {a.name}: connection refused",
        cause="connection refused"))
    out, slow, _, stores = _two_ranks(down)
    assert all(isinstance(exc, PrefetchError) for exc in out), out
    assert len({str(exc) for exc in out}) == 1
    assert "rank 1/2" in str(out[0]) and "connection refused" in str(out[0])
    assert down.total == 1  # its first failure stopped its own downloads
    # Rank 0's share is about half of the 40 (5 s of downloads); told at the next beat
    # (at most 1 s), it stopped after a few of them.
    assert 0 < slow.total <= 10, slow.total
    # What it did fetch is whole in its pool.
    blobs = slow.blobs
    assert all(blobs[sha] == data for sha, data in stores[0].objects.items())


def test_one_artifact_missing_at_the_origin_still_lets_every_rank_finish() -> None:
    missing: list[str] = []

    def error(artifact: Artifact) -> Exception | None:
        if missing:
            return None
        missing.append(artifact.name)
        return ArtifactNotFound(f"404 for fake://origin/{artifact.name}", status=404)

    partly = Failing({}, error)
    out, slow, arts, stores = _two_ranks(partly, slow_s=0.01)
    assert all(isinstance(exc, PrefetchError) for exc in out), out
    assert missing and missing[0] in str(out[0])
    # Every other artifact was fetched once and is in both pools.
    assert slow.total + partly.total == len(arts)
    held = {a.sha256 for a in arts if a.name not in missing}
    assert held <= set(stores[0].objects) and held <= set(stores[1].objects)


def test_ranks_that_all_succeed_are_not_halted() -> None:
    arts, blobs = make_blobs(6)
    stores = [Store("p0"), Store("p1")]
    origins = [FakeOrigin(blobs), FakeOrigin(blobs)]
    group = ThreadGroup(2, ["a", "b"], timeout=20)
    reports = ok(run_ranks(group, lambda r: prefetch(
        arts, comm=group.comm(r), pool=FakePool(stores[r]), origin=origins[r],
        downloads_per_rank=1, timeout=20)))
    assert sum(o.total for o in origins) == 6 and len(reports) == 2
    assert all(set(s.objects) == set(blobs) for s in stores)
