"""Agreeing on an adoption's nonce over a store that outlives processes (torchrun's
agent store): a handshake between the live processes, whatever restart counts the
nodes hold and whatever earlier processes left on the store."""

from __future__ import annotations

import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from distcache.comm._scope import RunScope, job_root, meet
from distcache.errors import CollectiveTimeout, CommError


class Store:
    """The part of a ``torch.distributed.Store`` that :func:`meet` uses, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        #: Every key :meth:`check` was asked about.
        self.checked: set[str] = set()

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self.data[key] = value.encode() if isinstance(value, str) else value
            self._changed.notify_all()

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            self.checked.update(keys)
            return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self._changed:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
                self._changed.notify_all()
                return desired.encode()
            return expected.encode() if current is None else current

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self.data for k in keys),
                                          timeout.total_seconds()):
                raise RuntimeError(f"wait timeout after {timeout}, keys: {keys}")

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self.data.pop(key, None) is not None


def _soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


def _ranks(store: Store, adoptions: list[tuple[int, float, str, int]], size: int,
           seconds: float = 5.0) -> list[Any]:
    """Run ``(rank, delay, job, attempt)`` adoptions at once on threads; each gives
    ``(nonce, attempt)`` or the error it raised."""
    def one(rank: int, delay: float, job: str, attempt: int) -> Any:
        time.sleep(delay)
        try:
            return meet(store, rank, size, job, attempt, _soon(seconds))
        except CommError as exc:
            return exc

    with ThreadPoolExecutor(len(adoptions)) as pool:
        return list(pool.map(lambda a: one(*a), adoptions))


def test_nodes_holding_different_restart_counts_meet_on_rank_0s() -> None:
    # torch raises TORCHELASTIC_RESTART_COUNT only on the node whose workers failed.
    store = Store()
    got = _ranks(store, [(0, 0.0, "torchrun:j", 1), (1, 0.1, "torchrun:j", 0),
                         (2, 0.2, "torchrun:j", 1), (3, 0.0, "torchrun:j", 0)], size=4)
    assert len(set(got)) == 1 and isinstance(got[0], tuple), got
    nonce, attempt = got[0]
    assert attempt == 1
    scope = RunScope("torchrun:j", attempt, nonce, b"s" * 32)
    assert scope.prefix == f"{job_root('torchrun:j')}/{nonce}"


def test_what_earlier_processes_left_on_the_store_is_never_taken_for_a_live_peer() -> None:
    store = Store()
    # Round 1: both meet; then rank 1 of an aborted round wrote its hello and died.
    first = _ranks(store, [(0, 0.0, "torchrun:j", 0), (1, 0.0, "torchrun:j", 0)], size=2)
    assert first[0] == first[1]
    store.set(f"{job_root('torchrun:j')}/hello/1", os.urandom(16).hex())
    # Round 2: rank 0 comes first and finds that hello; the live rank 1 comes 0.5 s
    # later. They meet under a nonce of their own.
    began = time.monotonic()
    again = _ranks(store, [(0, 0.0, "torchrun:j", 0), (1, 0.5, "torchrun:j", 0)], size=2)
    assert again[0] == again[1] and again[0][0] != first[0][0], again
    assert time.monotonic() - began < 3.0
    # A node joins (a membership change, no new restart count): three ranks meet.
    grown = _ranks(store, [(r, 0.1 * r, "torchrun:j", 0) for r in range(3)], size=3)
    assert len(set(grown)) == 1 and grown[0][0] not in (first[0][0], again[0][0])


def test_adoptions_in_a_row_each_meet_however_late_a_rank_comes() -> None:
    store = Store()
    seen = set()
    for _ in range(3):  # the wrapper, then two inits; rank 1 comes late each time
        zero, one = _ranks(store, [(0, 0.0, "j", 0), (1, 0.3, "j", 0)], size=2)
        assert isinstance(zero, tuple) and zero == one
        seen.add(zero[0])
    assert len(seen) == 3


def test_ranks_meeting_at_once_on_threads_agree_and_leave_two_keys_a_meeting() -> None:
    store = Store()
    for _ in range(20):
        got = _ranks(store, [(r, 0.0, "j", 0) for r in range(8)], size=8)
        assert len(set(got)) == 1 and isinstance(got[0], tuple)
    # On a store that lives as long as the job: each rank's hello, and per meeting its
    # state and arrival count; no answer or count-in key per rank stays behind.
    assert len(store.data) == 7 + 20 * 2, sorted(store.data)


def test_a_rank_that_never_comes_fails_every_rank_within_its_deadline() -> None:
    store = Store()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"this rank gave up.*rank 1 of 2 not come"):
        meet(store, 0, 2, "j", 0, time.monotonic() + 0.3)
    assert time.monotonic() - start < 2.0
    # Rank 1, after rank 0 gave up: no answer comes; it raises at its own deadline.
    late = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="rank 0 did not open"):
        meet(store, 1, 2, "j", 0, time.monotonic() + 0.5)
    assert time.monotonic() - late < 2.0
    # A rank whose deadline passes after rank 0 answered it marks the meeting
    # abandoned; rank 0, still waiting for a third rank, reads the same outcome at
    # once, names the rank that gave up, and answers that rank's retry next time.
    # Rank 1 comes once rank 0 looks for its hello, with time enough to be answered.
    store.checked.clear()
    with ThreadPoolExecutor(2) as pool:
        zero = pool.submit(meet, store, 0, 3, "j", 0, _soon(30.0))
        looking = time.monotonic() + 30
        while f"{job_root('j')}/hello/1" not in store.checked:
            assert time.monotonic() < looking and not zero.done(), "rank 0 never looked"
            time.sleep(0.01)
        began = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="this rank gave up"):
            meet(store, 1, 3, "j", 0, time.monotonic() + 2.0)
        with pytest.raises(CollectiveTimeout, match="rank 1 gave up"):
            zero.result()
        assert time.monotonic() - began < 10.0  # not rank 0's own 30 s


def test_another_job_on_the_same_store_is_never_answered() -> None:
    store = Store()
    with ThreadPoolExecutor(2) as pool:
        zero = pool.submit(meet, store, 0, 2, "job-a", 0, _soon(0.5))
        other = pool.submit(meet, store, 1, 2, "job-b", 0, _soon(0.5))
        with pytest.raises(CollectiveTimeout):
            zero.result()
        with pytest.raises(CollectiveTimeout):
            other.result()


def test_store_values_that_are_not_distcaches_are_refused_never_unpickled() -> None:
    class Boom:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, ("touch /nonexistent/should-never-run",))

    store = Store()
    root = job_root("j")
    store.set(f"{root}/hello/1", pickle.dumps(Boom()))
    with pytest.raises(CommError, match="not a nonce"):
        meet(store, 0, 2, "j", 0, _soon())
    # An answer that is not rank 0's: rank 1 reads it under its own token's key.
    def answer_junk() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            token = store.data.get(f"{root}/hello/1", b"")
            if len(token) == 32 and token != b"0" * 32:
                store.set(f"{root}/ack/1/{token.decode()}", pickle.dumps(Boom()))
                return
            time.sleep(0.01)

    store.set(f"{root}/hello/1", b"0" * 32)
    writer = threading.Thread(target=answer_junk)
    writer.start()
    with pytest.raises(CommError, match="other than rank 0's answer"):
        meet(store, 1, 2, "j", 0, _soon())
    writer.join()
