"""Streaming while downloading: what a pipelined source sends at each turn."""

from __future__ import annotations

import threading
import time

from distcache.collective._pipeline import Arrivals, ready_messages
from distcache.collective._stream import StreamStats, decode_bucket

BLOBS = {i: bytes([i]) * (100 + i) for i in range(10)}


def read(index: int) -> bytes | None:
    return BLOBS[index]


def entries(message: bytes) -> tuple[bool, list[tuple[int, bytes | None]]]:
    last, items = decode_bucket(message)
    return last, [(i, None if v is None else bytes(v)) for i, v in items]


def test_what_the_pool_holds_goes_first_then_each_download_as_it_arrives() -> None:
    arrivals = Arrivals([3, 4, 5])
    stats = StreamStats()
    stream = ready_messages((0, 1, 3, 4, 5), read, arrivals=arrivals, bucket_bytes=10_000,
                            stats=stats)
    last, got = entries(next(stream))
    assert not last and got == [(0, BLOBS[0]), (1, BLOBS[1])]
    arrivals.finished(4, True)
    last, got = entries(next(stream))
    assert not last and got == [(4, BLOBS[4])]
    arrivals.finished(3, True)
    arrivals.finished(5, True)
    last, got = entries(next(stream))
    assert last and got == [(3, BLOBS[3]), (5, BLOBS[5])]
    assert stats.broadcasts == 3


def test_a_turn_waits_for_the_first_arrival_instead_of_sending_nothing() -> None:
    arrivals = Arrivals([7])
    stream = ready_messages((7,), read, arrivals=arrivals, bucket_bytes=10_000,
                            stats=StreamStats())
    timer = threading.Timer(0.1, arrivals.finished, (7, True))
    timer.start()
    began = time.monotonic()
    last, got = entries(next(stream))
    assert time.monotonic() - began >= 0.05
    assert last and got == [(7, BLOBS[7])]


def test_a_failed_download_travels_as_a_missing_entry_and_close_ends_the_stream() -> None:
    arrivals = Arrivals([1, 2, 3])
    stream = ready_messages((1, 2, 3), read, arrivals=arrivals, bucket_bytes=10_000,
                            stats=StreamStats())
    arrivals.finished(2, False)
    last, got = entries(next(stream))
    assert not last and got == [(2, None)]
    # The downloads ran out of budget: what never finished will not arrive.
    arrivals.close()
    arrivals.finished(1, True)  # a late finisher no longer counts
    last, got = entries(next(stream))
    assert last and got == [(1, None), (3, None)]


def test_buckets_stay_within_bucket_bytes_and_carry_the_artifact_that_did_not_fit() -> None:
    indices = tuple(range(10))
    arrivals = Arrivals(indices)
    for i in indices:
        arrivals.finished(i, True)
    stats = StreamStats()
    messages = list(ready_messages(indices, read, arrivals=arrivals, bucket_bytes=250,
                                   stats=stats))
    decoded = [entries(m) for m in messages]
    assert [last for last, _ in decoded] == [False] * (len(decoded) - 1) + [True]
    sent = [i for _, got in decoded for i, _ in got]
    assert sorted(sent) == list(indices) and len(set(sent)) == 10
    for _, got in decoded:
        assert sum(len(b or b"") for _, b in got) <= 250 or len(got) == 1
    assert stats.peak_bytes <= 250 + max(len(b) for b in BLOBS.values())


def test_a_source_with_nothing_to_send_sends_one_empty_last_bucket() -> None:
    arrivals = Arrivals([])
    arrivals.close()
    messages = list(ready_messages((), read, arrivals=arrivals, bucket_bytes=100,
                                   stats=StreamStats()))
    assert [entries(m) for m in messages] == [(True, [])]
