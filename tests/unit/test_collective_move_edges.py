"""Edges of the move and of what a prefetch reports: a receiver that rejects a later
bucket, a prefetch whose object another job published first, and rank 0's progress
bar when a download is skipped."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.collective import _prefetch, _run, prefetch
from distcache.collective._bucket import decode_bucket, encode_bucket
from distcache.comm import ThreadGroup
from distcache.comm._base import Communicator
from distcache.errors import CollectiveTimeout, PrefetchError
from tests.support.bars import recording_bars
from tests.unit.test_prefetch import (
    FakeOrigin,
    FakePool,
    Store,
    Tally,
    TamperingComm,
    make_blobs,
    make_pools,
    ok,
    run_ranks,
)

pytestmark = pytest.mark.timeout(60)

#: A prefetch whose pools hold everything asks no origin.
NO_ORIGIN: Any = None


# -- a receiver that rejects a later bucket -----------------------------------------


class Deadlines:
    """How many collective calls ran into their deadline, on any rank."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.missed = 0

    def missed_one(self) -> None:
        with self.lock:
            self.missed += 1


class WatchedComm(TamperingComm):
    """A communicator that counts the calls that raised :class:`CollectiveTimeout`,
    through every split, and lets each bucket it receives pass through :meth:`tamper`."""

    deadlines = Deadlines()

    def _watched(self, call: Any) -> Any:
        try:
            return call()
        except CollectiveTimeout:
            self.deadlines.missed_one()
            raise

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        got: bytes = self._watched(lambda: self.inner.broadcast_bytes(data, root,
                                                                      timeout=timeout))
        return got if self.rank == root else self.tamper(got)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        got: list[Any] = self._watched(lambda: self.inner.allgather_object(obj,
                                                                           timeout=timeout))
        return got

    def barrier(self, *, timeout: float | None = None) -> None:
        self._watched(lambda: self.inner.barrier(timeout=timeout))


class LaterBucketComm(WatchedComm):
    """The third bucket with objects that this receiver gets is spoiled by
    :meth:`spoil`; the earlier ones pass as they are."""

    def __init__(self, inner: Communicator, world_rank: int, tally: Tally) -> None:
        super().__init__(inner, world_rank, tally)
        self.buckets: list[list[tuple[int, bytes | None]]] = []

    def split(self, color: int) -> Communicator:
        child = type(self)(self.inner.split(color), self.world_rank, self.tally)
        child.buckets = self.buckets  # one count over every communicator of the rank
        return child

    def tamper(self, got: bytes) -> bytes:
        try:
            last, entries = decode_bucket(got)
        except Exception:
            return got  # not a bucket
        items = [(i, None if v is None else bytes(v)) for i, v in entries]
        if not items:
            return got
        self.buckets.append(items)
        if len(self.buckets) != 3:
            return got
        return bytes(encode_bucket(self.spoil(items), last=last))

    def spoil(self, items: list[tuple[int, bytes | None]]) -> list[tuple[int, bytes | None]]:
        raise NotImplementedError


class RepeatingLaterComm(LaterBucketComm):
    """The third bucket names, beside its own, the object of the first once more."""

    def spoil(self, items: list[tuple[int, bytes | None]]) -> list[tuple[int, bytes | None]]:
        return items + self.buckets[0][:1]


class CorruptingLaterComm(LaterBucketComm):
    """The third bucket's first object arrives with one byte changed."""

    def spoil(self, items: list[tuple[int, bytes | None]]) -> list[tuple[int, bytes | None]]:
        index, data = items[0]
        assert data is not None
        return [(index, bytes([data[0] ^ 0xFF]) + data[1:]), *items[1:]]


def spoiled_later(monkeypatch: pytest.MonkeyPatch, receiving: type[LaterBucketComm],
                  *, one_thread: bool) -> tuple[list[Artifact], list[Any], Deadlines]:
    """Rank 0 holds four artifacts and sends them, one per bucket, to ranks 1 and 2;
    rank 1's communicator is ``receiving``. Each rank's result, and the deadlines that
    the calls on every rank ran into."""
    if one_thread:  # a transport that cannot take two threads: the move runs alone
        monkeypatch.setattr(_run, "concurrent", lambda comm: False)
        monkeypatch.setattr(_prefetch, "concurrent", lambda comm: False)
    deadlines = Deadlines()
    monkeypatch.setattr(WatchedComm, "deadlines", deadlines)
    arts, blobs = make_blobs(4, low=3000, high=3500)
    pools, stores = make_pools(3, lambda r: f"rank{r}")
    stores["rank0"].objects.update(blobs)
    timeout = 2.0
    group = ThreadGroup(3, timeout=timeout)
    tally = Tally()
    comms: list[Communicator] = [WatchedComm(group.comm(0), 0, tally),
                                 receiving(group.comm(1), 1, tally),
                                 WatchedComm(group.comm(2), 2, tally)]
    results = run_ranks(group, lambda r: prefetch(arts, comm=comms[r], pool=pools[r],
                                                  origin=NO_ORIGIN, bucket_bytes=4000,
                                                  timeout=timeout))
    return arts, results, deadlines


@pytest.mark.parametrize("one_thread", [True, False], ids=["one-thread", "beside-heartbeats"])
def test_a_later_bucket_naming_an_object_again_fails_every_rank_without_a_timeout(
    monkeypatch: pytest.MonkeyPatch, one_thread: bool,
) -> None:
    arts, results, deadlines = spoiled_later(monkeypatch, RepeatingLaterComm,
                                             one_thread=one_thread)
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({str(e) for e in results}) == 1, [str(e) for e in results]
    first = min(arts, key=lambda a: a.sha256)  # the first bucket's object
    assert results[0].rank == 1 and results[0].phase == "move"
    assert results[0].artifact == first.name and "sent before" in str(results[0])
    # The rejection was agreed on at once: no call on any rank waited out its deadline.
    assert deadlines.missed == 0


@pytest.mark.parametrize("one_thread", [True, False], ids=["one-thread", "beside-heartbeats"])
def test_a_later_bucket_failing_its_digest_fails_every_rank_without_a_timeout(
    monkeypatch: pytest.MonkeyPatch, one_thread: bool,
) -> None:
    arts, results, deadlines = spoiled_later(monkeypatch, CorruptingLaterComm,
                                             one_thread=one_thread)
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({str(e) for e in results}) == 1, [str(e) for e in results]
    third = sorted(arts, key=lambda a: a.sha256)[2]  # the third bucket's object
    assert results[0].rank == 1 and results[0].phase == "move"
    assert results[0].artifact == third.name and "IntegrityError" in str(results[0])
    assert deadlines.missed == 0


# -- what another job publishes first into the same pool -----------------------------


class ForestalledPool(FakePool):
    """A pool into which another job publishes ``first`` right after this prefetch
    asked what the pool holds (as a concurrent prefetch into the same pool would)."""

    def __init__(self, store: Store, first: dict[str, bytes]) -> None:
        super().__init__(store)
        self.first = first

    def holding(self, shas: Iterable[str]) -> list[bool]:
        held = super().holding(shas)
        with self.store.lock:
            for sha, data in self.first.items():
                if sha not in self.store.objects:
                    self.store.objects[sha] = data
                    self.store.journal.append(sha)
        return held


def test_a_download_skipped_for_an_object_published_meanwhile_advances_the_bar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = recording_bars(monkeypatch)
    arts, blobs = make_blobs(4)
    first = {arts[1].sha256: blobs[arts[1].sha256]}
    pool = ForestalledPool(Store("nfs"), first)
    origin: Any = FakeOrigin(blobs)
    group = ThreadGroup(1, timeout=5)
    ok(run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pool,
                                           origin=origin, timeout=5)))
    assert origin.requests[arts[1].name] == 0  # skipped: the other job published it
    assert set(pool.store.objects) == set(blobs)
    assert len(made) == 1
    assert made[0].total == sum(len(b) for b in blobs.values())
    assert made[0].n == made[0].total


def test_objects_published_counts_deliveries_to_pools_that_lacked_them_when_looked() -> None:
    arts, blobs = make_blobs(4)
    other = min(blobs)  # published into rank 1's pool by another job, after discovery
    source, target = Store("rank0"), Store("rank1")
    source.objects.update(blobs)
    pools = [FakePool(source), ForestalledPool(target, {other: blobs[other]})]
    group = ThreadGroup(2, timeout=5)
    reports = ok(run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                                     origin=NO_ORIGIN, timeout=5)))
    assert set(target.objects) == set(blobs)
    # The other job placed one of the four after discovery; the report counts the
    # four this prefetch delivered to a pool that lacked them when it looked (its
    # documented meaning), each object journaled once whoever placed it.
    assert target.journal[0] == other and len(target.journal) == 4
    assert {r.objects_published for r in reports} == {4}
