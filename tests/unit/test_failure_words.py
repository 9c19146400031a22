"""A rank's own failure told to the others (:mod:`distcache.comm._announce`) over a
fake point-to-point transport: the word reaches every rank through rank 0, each
raises the failure it names (the class, the message, where it came from), only a
rank's own failures are told, and a word that is not one is refused by name."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import pytest

from distcache.comm import _announce
from distcache.comm._announce import (
    ANNOUNCE_TAG,
    MAX_WORD_BYTES,
    Announcements,
    _word,
    tell_others,
    to_announce,
    watched,
)
from distcache.comm._codec import encode
from distcache.errors import (
    CollectiveTimeout,
    CommError,
    ConfigError,
    PoolError,
    RemoteError,
    WireError,
)


class _Status:
    def __init__(self) -> None:
        self.source, self.count = -1, -1

    def Get_source(self) -> int:
        return self.source

    def Get_count(self, kind: Any) -> int:
        return self.count


class _Request:
    def Test(self) -> bool:
        return True


class _Message:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def Recv(self, message: list[Any]) -> None:
        buffer = message[0]
        if len(self.data) > len(buffer):
            raise _Net.Exception("MPI_ERR_TRUNCATE: message truncated")
        buffer[:len(self.data)] = self.data


class _Net:
    """Mailboxes per destination; a send is delivered at once, like a small MPI message."""

    BYTE = "B"
    ANY_SOURCE = -1
    Status = _Status

    class Exception(RuntimeError):
        pass

    class Request:
        @staticmethod
        def Testall(requests: list[_Request]) -> bool:
            return all(r.Test() for r in requests)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.boxes: dict[int, deque[tuple[int, int, bytes]]] = {}
        self.probes = 0
        self.sent: list[tuple[int, int]] = []


class _Comm:
    def __init__(self, net: _Net, rank: int) -> None:
        self.net, self.rank = net, rank

    def Isend(self, message: list[Any], dest: int, tag: int) -> _Request:
        with self.net.lock:
            self.net.boxes.setdefault(dest, deque()).append((self.rank, tag, bytes(message[0])))
            self.net.sent.append((self.rank, dest))
        return _Request()

    def Improbe(self, source: int, tag: int, status: _Status) -> _Message | None:
        with self.net.lock:
            self.net.probes += 1
            box = self.net.boxes.get(self.rank, deque())
            for i, (src, got_tag, data) in enumerate(box):
                if got_tag == tag and source in (src, _Net.ANY_SOURCE):
                    del box[i]
                    status.source, status.count = src, len(data)
                    return _Message(data)
        return None


def _ranks(size: int, net: _Net | None = None) -> list[Announcements]:
    net = _Net() if net is None else net
    return [Announcements(net, _Comm(net, r), r, size, f"node{r // 2}") for r in range(size)]


@pytest.fixture(autouse=True)
def _look_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_announce, "FIRST_LOOK_S", 0.0)


def _heard(ranks: list[Announcements], rank: int) -> BaseException | None:
    try:
        ranks[rank].looker()()
    except BaseException as exc:
        return exc
    return None


def test_a_ranks_failure_reaches_every_rank_through_rank_0() -> None:
    ranks = _ranks(4)
    assert ranks[2].announce(PoolError("cannot create pool root /p: Not a directory"))
    assert [dest for _, dest in ranks[0]._comm.net.sent] == [0]  # only to rank 0
    assert _heard(ranks, 1) is None  # rank 0 has not passed it on yet
    for rank in (0, 1, 3):
        error = _heard(ranks, rank)
        assert type(error) is PoolError, error
        assert str(error) == (f"rank 2/4 (node1) failed, so rank {rank} stops: cannot "
                              "create pool root /p: Not a directory")
        assert error.rank == 2 and error.host == "node1" and error.agreed
        # Every later wait raises it again, a fresh error each time.
        again = _heard(ranks, rank)
        assert type(again) is PoolError and again is not error
    # Rank 0 passed it on once, to each rank but the one it came from.
    assert sorted(d for s, d in ranks[0]._comm.net.sent if s == 0) == [1, 3]


def test_rank_0s_own_failure_goes_to_every_rank_at_once() -> None:
    ranks = _ranks(3)
    assert ranks[0].announce(ConfigError("bad DISTCACHE_POOL", variable="DISTCACHE_POOL"))
    for rank in (1, 2):
        error = _heard(ranks, rank)
        assert type(error) is ConfigError and error.variable == "DISTCACHE_POOL"
        assert "rank 0/3 (node0) failed" in str(error) and "bad DISTCACHE_POOL" in str(error)


def test_an_error_not_of_distcache_arrives_as_a_remote_error_naming_its_class() -> None:
    ranks = _ranks(2)
    assert ranks[1].announce(KeyboardInterrupt())
    error = _heard(ranks, 0)
    assert type(error) is RemoteError and error.remote_type == "KeyboardInterrupt"
    assert error.rank == 1 and "rank 1/2 on node0 failed with KeyboardInterrupt" in str(error)


def test_two_failing_ranks_make_each_rank_raise_one_failure_passed_on_once() -> None:
    ranks = _ranks(5)
    ranks[3].announce(PoolError("disk full on 3"))
    ranks[1].announce(PoolError("disk full on 1"))
    first = _heard(ranks, 0)
    assert first is not None and "disk full on 3" in str(first)
    relayed = [d for s, d in ranks[0]._comm.net.sent if s == 0]
    assert sorted(relayed) == [1, 2, 4]
    assert "disk full on 3" in str(_heard(ranks, 2))
    _heard(ranks, 0)
    assert [d for s, d in ranks[0]._comm.net.sent if s == 0] == relayed


def test_a_rank_tells_once_and_not_after_hearing_of_another_failure() -> None:
    ranks = _ranks(3)
    assert ranks[1].announce(PoolError("first"))
    assert not ranks[1].announce(PoolError("second"))
    _heard(ranks, 0)
    assert not ranks[0].announce(PoolError("mine, after hearing"))
    assert not _ranks(1)[0].announce(PoolError("alone"))


@pytest.mark.parametrize(("error", "told"), [
    (PoolError("cannot create pool root"), True),
    (OSError(28, "No space left on device"), True),
    (KeyboardInterrupt(), True),
    (CollectiveTimeout("barrier did not complete"), False),
    (CommError("MPI_ERR_COMM"), False),
    (SystemExit(1), False),
    (PoolError("raised alike on every rank"), False),
    (PoolError("from rank 3", rank=3), False),
    (PoolError("this rank's own", rank=1), True),
])
def test_only_a_ranks_own_failures_are_told(error: BaseException, told: bool) -> None:
    if "alike" in str(error):
        error.agreed = True  # type: ignore[attr-defined]
    assert to_announce(error, 1) is told


def test_tell_others_asks_the_communicator_only_for_failures_to_tell() -> None:
    class Comm:
        rank, size = 1, 4

        def __init__(self) -> None:
            self.told: list[BaseException] = []

        def announce(self, error: BaseException) -> bool:
            self.told.append(error)
            return True

    comm = Comm()
    assert tell_others(comm, PoolError("mine"))
    assert not tell_others(comm, CollectiveTimeout("everyone's"))
    assert len(comm.told) == 1
    assert not tell_others(object(), PoolError("no announce: not MPI"))


def test_a_long_message_is_cut_to_fit_one_word() -> None:
    word = _word(7, "node3", PoolError("x" * 50_000, path="/p" * 3_000))
    assert len(word) <= MAX_WORD_BYTES
    ranks = _ranks(8)
    ranks[7].announce(PoolError("y" * 50_000))
    error = _heard(ranks, 0)
    assert type(error) is PoolError and str(error).endswith(" [...]")
    assert str(error).startswith("rank 7/8 (node3) failed, so rank 0 stops: yyy")


@pytest.mark.parametrize(("data", "what"), [
    (b"\xff" * (MAX_WORD_BYTES + 1), "bytes long"),
    (b"\xff\xfe", "not in the wire codec"),
    (encode((9, "node0", ("PoolError", "x", "PoolError", {}))), "triple"),
    (encode((1, "node0", ("PoolError", "x", "NoSuchError", {}))), "not an error's"),
    (encode(("1", "node0", ("PoolError", "x", "PoolError", {}))), "triple"),
])
def test_a_word_that_is_not_one_is_refused_naming_its_sender(data: bytes, what: str) -> None:
    ranks = _ranks(4)
    ranks[1]._comm.Isend([bytearray(data)], 0, ANNOUNCE_TAG)
    error = _heard(ranks, 0)
    assert type(error) is WireError and error.peer == 1, error
    assert what in str(error) and "rank 1" in str(error)


def test_a_short_wait_never_looks_and_a_long_one_looks_at_growing_gaps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_announce, "FIRST_LOOK_S", 0.02)
    net = _Net()
    ranks = _ranks(2, net)
    now = [100.0]
    monkeypatch.setattr(_announce.time, "monotonic", lambda: now[0])
    look = ranks[0].looker()
    for _ in range(50):  # polls within the first 20 ms
        now[0] += 0.0003
        look()
    assert net.probes == 0
    for _ in range(100_000):  # a 100 s wait, polled every millisecond
        now[0] += 0.001
        look()
    # Gaps of a tenth of the time waited, at most half a second: a few hundred looks.
    assert 150 < net.probes < 260, net.probes


def test_a_watched_wait_stops_at_a_word_but_not_after_its_test_came_true() -> None:
    ranks = _ranks(2)
    done = watched(lambda: True, ranks[0].looker())
    ranks[1].announce(PoolError("late"))
    assert done() is True  # complete: the word is for the next wait
    pending = watched(lambda: False, ranks[0].looker())
    with pytest.raises(PoolError, match="late"):
        pending()


def test_a_communicator_whose_words_are_spent_is_retired_with_the_failure_named() -> None:
    ranks = _ranks(3)
    assert ranks[0].spent is None
    ranks[2].announce(PoolError("mine"))
    assert ranks[2].spent == "rank 2/3 (node1, this rank) failed"
    _heard(ranks, 0)
    assert ranks[0].spent == "rank 2/3 (node1) failed"
    assert ranks[1].spent is None  # not heard yet
