"""MPI's arrival check before ``Dup`` (:func:`distcache.comm._arrival._arrive`) over a
fake point-to-point transport, with the ranks arriving at different times: either
every rank goes on to ``Dup`` or none does, even where a rank gave up after its
arrival had already been delivered; no rank reads another's clock, and what a failed
check left behind is not taken for the next one's."""

from __future__ import annotations

import os
import struct
import threading
import time
from collections import deque
from typing import Any

import pytest

from distcache.comm._arrival import (
    ARRIVAL_TAG,
    NODE_KEY_BYTES,
    _arrival_tree,
    _arrive,
    _last,
)
from distcache.errors import CollectiveTimeout


class _Request:
    def __init__(self, net: _Net, test: Any) -> None:
        self._net, self._test, self._done, self.cancelled = net, test, False, False

    def Test(self) -> bool:
        with self._net.lock:
            if not (self._done or self.cancelled):
                self._done = self._test()
            return self._done

    def Cancel(self) -> None:
        with self._net.lock:
            self.cancelled = not self._done

    def Wait(self) -> None:
        return None


class _Net:
    """Mailboxes per (source, destination, tag): a send is delivered at once (eagerly,
    like MPI's small messages), whether or not the destination is listening yet, and
    cannot be taken back."""

    BYTE = "B"
    Exception = RuntimeError

    class Request:
        @staticmethod
        def Testall(requests: list[_Request]) -> bool:
            return all([r.Test() for r in requests])

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.boxes: dict[tuple[int, int, int], deque[bytes]] = {}

    def box(self, source: int, dest: int, tag: int) -> deque[bytes]:
        return self.boxes.setdefault((source, dest, tag), deque())


class _Comm:
    def __init__(self, net: _Net, rank: int, size: int) -> None:
        self.net, self.rank, self.size = net, rank, size

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Isend(self, message: list[Any], dest: int, tag: int) -> _Request:
        with self.net.lock:
            self.net.box(self.rank, dest, tag).append(bytes(message[0]))
        return _Request(self.net, lambda: True)

    def Irecv(self, message: list[Any], source: int, tag: int) -> _Request:
        buffer, box = message[0], self.net.box(source, self.rank, tag)

        def test() -> bool:
            if not box:
                return False
            got = box.popleft()
            buffer[:len(got)] = got
            return True

        return _Request(self.net, test)


def _key(rank: int) -> bytes:
    return bytes([rank + 1]) * NODE_KEY_BYTES


def _run(entries: list[float | None], timeout: float, net: _Net | None = None) -> list[Any]:
    """Every rank's ``_arrive`` (what it returned or raised), rank ``r`` entering
    ``entries[r]`` seconds after the start (never where that is ``None``) in a thread
    named ``rank<r>``, rank 0 passing the word ``b"w0"``; over ``net`` where given."""
    net = _Net() if net is None else net
    size = len(entries)
    results: list[Any] = [None] * size
    start = time.monotonic() + 0.05

    def one(rank: int, entry: float) -> None:
        time.sleep(max(0.0, start + entry - time.monotonic()))
        try:
            results[rank] = _arrive(net, _Comm(net, rank, size), timeout,
                                    b"w%d" % rank, _key(rank))
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r, e), name=f"rank{r}", daemon=True)
               for r, e in enumerate(entries) if e is not None]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(e for e in entries if e is not None) + 3 * timeout + 5)
        assert not thread.is_alive(), "the arrival check hung"
    return results


@pytest.mark.parametrize("entries", [
    [0.0, 0.0, 0.0, 0.0],
    [0.1, 0.0, 0.05, 0.15, 0.02],            # children before their parents
    [0.0, 0.2, 0.1, 0.0, 0.15, 0.05, 0.2, 0.1],
])
def test_ranks_that_arrive_in_time_all_get_rank_0s_word_and_every_key(
        entries: list[float]) -> None:
    results = _run(entries, timeout=3.0)
    keys = [_key(r) for r in range(len(entries))]
    assert results == [(b"w0", keys)] * len(entries)


@pytest.mark.parametrize(("entries", "early"), [
    # Rank 1 arrives alone, gives up at 1 s with its arrival already delivered to
    # rank 0; ranks 0 and 2 come at 0.8 s, rank 3 at 1.2 s, all within rank 0's time.
    ([0.8, 0.0, 0.8, 1.2], 1),
    # The same below an inner node: rank 5 (under rank 4) gives up first.
    ([0.8, 0.8, 0.8, 0.8, 0.8, 0.0, 0.8, 1.2], 5),
])
def test_a_rank_that_gave_up_after_its_arrival_was_delivered_stops_every_rank(
        entries: list[float], early: int) -> None:
    results = _run(entries, timeout=1.0)
    assert all(isinstance(r, CollectiveTimeout) for r in results), results
    for rank, error in enumerate(results):
        if rank != early:
            assert "a rank's wait for the arrival check ran out" in str(error)


def test_a_rank_too_near_its_deadline_for_the_word_to_reach_it_stops_every_rank() -> None:
    # Every rank is here at 0.9 s, but rank 1 gives up at 1 s: a word to go would
    # reach it too late where a real transport takes time, so none is sent.
    results = _run([0.9, 0.0, 0.9, 0.9], timeout=1.0)
    assert all(isinstance(r, CollectiveTimeout) for r in results), results


@pytest.mark.parametrize("skew", [-1.0, 1.0, -3600.0, 3600.0])
def test_ranks_whose_wall_clocks_disagree_still_start(
        monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    # Each rank's host clock is off by ``skew`` seconds per rank number (every child
    # then reads its parent's clock as behind or ahead of its own), as on a cluster
    # without NTP; the check must not depend on them agreeing.
    real = time.time

    def host_clock() -> float:
        name = threading.current_thread().name
        return real() + (skew * int(name[4:]) if name.startswith("rank") else 0.0)

    monkeypatch.setattr(time, "time", host_clock)
    entries: list[float | None] = [0.1, 0.0, 0.05, 0.15, 0.02, 0.0, 0.2, 0.1]
    results = _run(entries, timeout=3.0)
    assert results == [(b"w0", [_key(r) for r in range(8)])] * 8


def _leftovers(net: _Net, size: int) -> None:
    """What failed checks on the same communicator could leave queued: a ready and a
    word to go from each parent, an arrival with a long time left from each child,
    none of them taken."""
    for rank in range(1, size):
        parent = _arrival_tree(rank, size)[0]
        assert parent is not None
        keys = b"".join(_key(r) for r in range(rank, _last(rank, size) + 1))
        net.box(rank, parent, ARRIVAL_TAG).append(
            b"a" + os.urandom(8) + struct.pack("!d", 1000.0) + keys)
        net.box(parent, rank, ARRIVAL_TAG).extend([
            b"r" + os.urandom(8),
            b"g" + os.urandom(8) + b"w9" + b"".join(_key(r) for r in range(size))])


def test_what_an_earlier_check_left_behind_does_not_count_as_a_rank_here() -> None:
    # Rank 5 is not here, but its old arrival (with plenty of time left) waits at rank
    # 4 and old readies and words to go wait at every rank: no rank may go on to Dup.
    net = _Net()
    _leftovers(net, 8)
    results = _run([0.0, 0.0, 0.0, 0.0, 0.0, None, 0.0, 0.0], timeout=0.5, net=net)
    here = [r for i, r in enumerate(results) if i != 5]
    assert all(isinstance(r, CollectiveTimeout) for r in here), results
    assert "rank(s) 5 did not arrive" in str(results[4])


def test_a_check_after_a_failed_one_on_the_same_communicator_succeeds() -> None:
    net = _Net()
    _leftovers(net, 8)
    # A failed check whose ready to rank 3 (which never came) stays queued, untaken ...
    failed = _run([0.0, 0.0, 0.0, None, 0.0, 0.0, 0.0, 0.0], timeout=0.3, net=net)
    assert all(isinstance(r, CollectiveTimeout) for i, r in enumerate(failed) if i != 3)
    # ... and the next check on the same transport takes only its own messages.
    results = _run([0.05, 0.0, 0.1, 0.0, 0.02, 0.0, 0.1, 0.0], timeout=3.0, net=net)
    assert results == [(b"w0", [_key(r) for r in range(8)])] * 8
