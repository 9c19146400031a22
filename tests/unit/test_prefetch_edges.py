"""Edges of the collective prefetch: a move on a transport that cannot take two threads,
buckets that leave out or mislabel what a receiver needs, a failed flush, and rank 0's
progress bar when the prefetch fails."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterable, Iterator

import pytest

from distcache.collective import _prefetch, _run, prefetch
from distcache.collective._bucket import decode_bucket, encode_bucket
from distcache.comm import ThreadGroup
from distcache.comm._base import Communicator
from distcache.errors import PoolError, PrefetchError, WireError
from tests.support.bars import recording_bars
from tests.unit.test_prefetch import (
    CountingComm,
    FakeOrigin,
    FakePool,
    ForgingComm,
    Tally,
    TamperingComm,
    make_blobs,
    make_pools,
    ok,
    run_ranks,
    sent_to_one,
)

pytestmark = pytest.mark.timeout(60)


class DroppingComm(TamperingComm):
    """The first entry of each bucket received is left out of the bucket."""

    def tamper(self, got: bytes) -> bytes:
        last, entries = decode_bucket(got)
        kept = [(i, None if v is None else bytes(v)) for i, v in entries[1:]]
        return bytes(encode_bucket(kept, last=last))


def test_a_bucket_that_leaves_out_an_object_fails_the_prefetch_on_every_rank() -> None:
    # One bucket holds all four: the one left out is the first sent, the lowest digest.
    arts, blobs, stores, results = sent_to_one(DroppingComm, bucket_bytes=1 << 20, timeout=5)
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({str(e) for e in results}) == 1
    assert results[0].rank == 1 and results[0].phase == "move"
    first = min(arts, key=lambda a: a.sha256)
    assert results[0].artifact == first.name and "ended without" in str(results[0])
    assert set(stores["rank1"].objects) == set(blobs) - {first.sha256}


def test_a_bucket_entry_with_a_negative_length_other_than_unreadable_is_malformed() -> None:
    good = encode_bucket([(0, b"abc"), (1, None)], last=True)
    assert decode_bucket(good, 2)[1][1] == (1, None)
    bad = bytearray(good)
    # The second table entry (after 3 payload bytes and the first entry): length -2.
    struct.pack_into("<Iq", bad, 3 + 12, 1, -2)
    with pytest.raises(WireError, match="length"):
        decode_bucket(bad, 2)


def test_a_malformed_bucket_in_a_move_on_one_thread_fails_every_rank_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A transport that cannot take two threads (MPI below THREAD_MULTIPLE): the move
    # runs on the calling thread after the fetch.
    monkeypatch.setattr(_run, "concurrent", lambda comm: False)
    monkeypatch.setattr(_prefetch, "concurrent", lambda comm: False)
    arts, blobs = make_blobs(4)
    pools, stores = make_pools(3, lambda r: f"rank{r}")
    stores["rank0"].objects.update(blobs)
    group = ThreadGroup(3, timeout=4)
    tally = Tally()
    comms: list[Communicator] = [CountingComm(group.comm(0), 0, tally),
                                 ForgingComm(group.comm(1), 1, tally),
                                 CountingComm(group.comm(2), 2, tally)]
    # One bucket: the receiver that rejects it is the only rank the move fails on.
    results = run_ranks(group, lambda r: prefetch(arts, comm=comms[r], pool=pools[r],
                                                  origin=None, bucket_bytes=1 << 20,
                                                  timeout=4))
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({str(e) for e in results}) == 1, [str(e) for e in results]
    assert results[0].rank == 1 and "malformed bucket" in str(results[0])
    assert stores["rank1"].objects == {}


class FlushFailingPool(FakePool):
    """A pool whose waited-for flushes fail (a background one is only logged)."""

    def batch(self, *, wait: bool = True) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def failing() -> Iterator[None]:
            yield
            if wait:
                raise PoolError(f"cannot flush {self.pool_id}: I/O error")

        return failing()


def test_a_failed_flush_of_the_move_names_no_artifact() -> None:
    arts, blobs = make_blobs(4)
    _, stores = make_pools(2, lambda r: f"rank{r}")
    stores["rank0"].objects.update(blobs)
    pools = [FakePool(stores["rank0"]), FlushFailingPool(stores["rank1"])]
    group = ThreadGroup(2, timeout=5)
    results = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                                  origin=None, bucket_bytes=8000,
                                                  timeout=5))
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({str(e) for e in results}) == 1
    err = results[0]
    assert err.rank == 1 and "cannot flush" in str(err)
    assert err.artifact is None
    assert all(a.name not in str(err) for a in arts)


def test_rank0_progress_bar_is_closed_when_the_prefetch_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = recording_bars(monkeypatch)
    arts, blobs = make_blobs(6)
    origin = FakeOrigin(blobs)
    origin.fail = {arts[-1].name}
    pools, _ = make_pools(2, lambda r: f"rank{r}")
    group = ThreadGroup(2, timeout=5)
    results = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                                  origin=origin, timeout=5))
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len(made) == 1 and made[0].closed
    # A prefetch that succeeds closes it too.
    origin.fail = set()
    made.clear()
    fresh = ThreadGroup(2, timeout=5)
    ok(run_ranks(fresh, lambda r: prefetch(arts, comm=fresh.comm(r), pool=pools[r],
                                           origin=origin, timeout=5)))
    assert made and all(bar.closed for bar in made)


class ShortHoldingPool(FakePool):
    """A pool that answers for fewer objects than it is asked about."""

    def holding(self, shas: Iterable[str]) -> list[bool]:
        return super().holding(list(shas)[:-1])


def test_a_malformed_have_set_fails_every_rank_alike_with_a_typed_error() -> None:
    # 9 objects: 8 flags fit a byte, 9 take two; the bitmap is malformed.
    arts, blobs = make_blobs(9)
    _, stores = make_pools(2, lambda r: f"rank{r}")
    pools = [FakePool(stores["rank0"]), ShortHoldingPool(stores["rank1"])]
    group = ThreadGroup(2, timeout=5)
    results = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                                  origin=FakeOrigin(blobs), timeout=5))
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({str(e) for e in results}) == 1
    assert results[0].rank == 1 and results[0].phase == "discover"
    assert "malformed have-set" in str(results[0])


class RepeatingComm(TamperingComm):
    """Each bucket received names its first object twice."""

    def tamper(self, got: bytes) -> bytes:
        last, entries = decode_bucket(got)
        items = [(i, None if v is None else bytes(v)) for i, v in entries]
        return bytes(encode_bucket(items + items[:1], last=last))


def test_a_bucket_that_names_an_object_twice_is_a_malformed_bucket_on_every_rank() -> None:
    _, _, _, results = sent_to_one(RepeatingComm, bucket_bytes=1 << 20, timeout=3)
    assert all(isinstance(e, PrefetchError) for e in results), results
    assert len({str(e) for e in results}) == 1
    assert results[0].rank == 1 and "malformed bucket" in str(results[0])
    assert "sent before" in str(results[0])
