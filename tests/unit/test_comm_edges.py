"""Edge cases of the communicator layer: bad timeouts, forged peer payloads, node
trees fed a forged answer, and what a failed collective leaves behind."""

from __future__ import annotations

import math
import sys
import threading
import time
import tracemalloc
import types
from collections.abc import Callable
from typing import Any, Self

import pytest

from distcache.comm import Communicator, LocalCommunicator, NodeTree, ThreadGroup
from distcache.comm._backend import BackendCommunicator, Budget
from distcache.comm._base import poll_until
from distcache.comm._codec import decode, encode
from distcache.errors import CollectiveTimeout, CommError, WireError
from tests.support.threads import run_ranks

BAD_TIMEOUTS = (0.0, -1.0, math.nan, math.inf)


def in_thread(fn: Callable[[], Any], limit: float = 5.0) -> Any:
    """``fn()`` (or what it raised) on a thread; fails the test if it runs past ``limit``."""
    box: list[Any] = []

    def one() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=one, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), "the call hung"
    return box[0]


class _Threaded(BackendCommunicator):
    """A :class:`BackendCommunicator` whose transport is a :class:`ThreadGroup`."""

    _kind = "threads-backend"
    _label = "thread"

    def __init__(self, group: ThreadGroup, rank: int, **options: Any) -> None:
        super().__init__(**options)
        self._group = group
        self._rank, self._size = rank, group.size

    def _swap(self, obj: Any, op: str, budget: Budget) -> list[Any]:
        wait = max(0.001, budget.until - time.monotonic())
        return self._group._exchange(self._rank, obj, op, wait)

    def _broadcast_block(self, block: bytes | None, width: int, root: int,
                         budget: Budget) -> bytes:
        got: bytes = self._swap(block, "broadcast_bytes", budget)[root]
        return got

    def _payload_buffer(self, data: bytes | None, total: int) -> bytearray:
        return bytearray(data) if data is not None else bytearray(total)

    def _broadcast_span(self, buffer: bytearray, start: int, stop: int, root: int,
                        budget: Budget) -> None:
        mine = bytes(buffer[start:stop]) if self._rank == root else None
        buffer[start:stop] = self._swap(mine, "broadcast_bytes", budget)[root]

    def _buffer_bytes(self, buffer: bytearray) -> bytes:
        return bytes(buffer)

    def _allgather_blocks(self, block: bytes, budget: Budget) -> list[Any]:
        return self._swap(block, "allgather_object", budget)

    def _allgather_payloads(self, mine: bytes, lengths: list[int],
                            budget: Budget) -> list[Any]:
        return self._swap(mine, "allgather_object", budget)

    def _barrier(self, budget: Budget) -> None:
        self._swap(None, "barrier", budget)

    def _split_child(self, colors: tuple[int, ...], color: int) -> Self:
        members = [r for r, c in enumerate(colors) if c == color]
        child = self._group._child(self._rank, color, members)
        return type(self)(child, members.index(self._rank), **self._inherited())


# -- timeouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_a_thread_group_refuses_a_timeout_that_is_not_a_positive_number(bad: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ThreadGroup(2, timeout=bad)


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_a_thread_rank_refuses_a_bad_timeout_instead_of_waiting_forever(bad: float) -> None:
    group = ThreadGroup(2, timeout=5.0)
    got = in_thread(lambda: group.comm(0).barrier(timeout=bad))  # rank 1 never comes
    assert isinstance(got, ValueError) and "timeout" in str(got)


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_a_backend_refuses_a_bad_timeout_per_call(bad: float) -> None:
    comm = _Threaded(ThreadGroup(2, timeout=5.0), 0, timeout=5.0)
    for call in (lambda: comm.barrier(timeout=bad),
                 lambda: comm.allgather_object(1, timeout=bad),
                 lambda: comm.broadcast_bytes(b"x", 0, timeout=bad)):
        got = in_thread(call)
        assert isinstance(got, ValueError) and "timeout" in str(got)
    assert comm.usable  # refused before it communicated


def test_a_backend_refuses_an_infinite_default_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        _Threaded(ThreadGroup(1), 0, timeout=math.inf)


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_the_world_of_one_refuses_a_bad_timeout_as_the_others_do(bad: float) -> None:
    comm = LocalCommunicator("n0")
    with pytest.raises(ValueError, match="timeout"):
        comm.allgather_object(1, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        comm.barrier(timeout=bad)


@pytest.mark.parametrize("bad", BAD_TIMEOUTS)
def test_a_node_tree_refuses_a_bad_timeout(bad: float) -> None:
    group = ThreadGroup(4, ["a", "a", "b", "b"], timeout=5.0)

    def body(comm: Communicator) -> Any:
        tree = NodeTree(comm)
        try:
            tree.allgather_object(comm.rank, timeout=bad)
        except ValueError as exc:
            return exc
        return None

    assert all(isinstance(r, ValueError) and "timeout" in str(r) for r in run_ranks(group, body))


def test_polling_against_a_nan_deadline_gives_up() -> None:
    assert in_thread(lambda: poll_until(lambda: False, math.nan)) is False


# -- forged payloads --------------------------------------------------------------------


def test_a_split_refuses_a_peer_that_sends_no_color_alike() -> None:
    group = ThreadGroup(3, timeout=5.0)

    def body(comm: Communicator) -> Any:
        mine = _Threaded(group, comm.rank, timeout=5.0)
        if comm.rank == 2:  # a peer of another version, or a forged one
            return mine.allgather_object("not a color")
        return mine.split(0)

    results = run_ranks(group, body)
    assert all(isinstance(r, WireError) and getattr(r, "peer", None) == 2 for r in results[:2]), results


def test_split_owned_refuses_a_color_that_is_not_an_int() -> None:
    group = ThreadGroup(2, timeout=5.0)

    def body(comm: Communicator) -> Any:
        mine = _Threaded(group, comm.rank, timeout=5.0)
        if comm.rank == 1:
            return mine.allgather_object([1, 2])
        return mine.split_owned(0)

    got = run_ranks(group, body)[0]
    assert isinstance(got, WireError) and getattr(got, "peer", None) == 1, got


class _Forging(NodeTree):
    """A node tree whose first node's leader hands its node ``answer`` instead of
    the table; the other leaders fold honestly."""

    answer: Any = None

    def _fold(self, blocks: list[Any]) -> Any:
        return self.answer if self.node_index == 0 else super()._fold(blocks)


def _forged(answer: Any) -> list[Any]:
    group = ThreadGroup(4, ["a", "a", "b", "b"], timeout=5.0)

    def body(comm: Communicator) -> Any:
        tree = _Forging(comm)
        tree.answer = answer
        return tree.allgather_object(comm.rank)

    return run_ranks(group, body)


@pytest.mark.parametrize("answer", [
    ([encode(1)], [1, 0, 1, 5, 2, 0]),  # an index past the table
    ([encode(1)], [4, 0, 1]),           # an odd number of run fields
    ([encode(1)], [4.0, 0]),            # a count that is not an int
    ([encode(1)], [-1, 0, 5, 0]),       # a negative count
    ([encode(1)], [4, "0"]),            # an index that is not an int
    ([1], [4, 0]),                      # a table entry that is not bytes
])
def test_a_forged_leader_answer_is_a_wire_error_on_every_rank_of_its_node(
        answer: Any) -> None:
    results = _forged(answer)
    assert all(isinstance(r, WireError) for r in results[:2]), results
    assert results[2:] == [[0, 1, 2, 3]] * 2


def test_a_forged_run_count_is_refused_before_it_is_expanded() -> None:
    tracemalloc.start()
    try:
        results = _forged(([encode(1)], [5_000_000, 0]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(isinstance(r, WireError) for r in results[:2]), results
    assert peak < 8 << 20, f"{peak} bytes allocated for a forged run"


def test_decode_takes_a_strided_view() -> None:
    payload = encode([1, "x"])
    spread = bytearray(2 * len(payload))
    spread[::2] = payload
    assert decode(memoryview(spread)[::2]) == [1, "x"]


# -- resources --------------------------------------------------------------------------


def test_a_bulk_group_made_on_some_ranks_is_closed_when_another_rank_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.comm import _bulk

    made: list[Any] = []

    class FakeNccl:
        def __init__(self, store: Any, rank: int, size: int, **options: Any) -> None:
            if rank == 1:
                raise CommError("no NCCL here", op="init", rank=rank)
            self.closed = False
            made.append(self)

        def close(self) -> None:
            self.closed = True

    fake = types.ModuleType("distcache.comm._gloo")
    fake.NcclCommunicator = FakeNccl  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "distcache.comm._gloo", fake)
    monkeypatch.setattr(_bulk, "shared_store", lambda comm, timeout: object())
    group = ThreadGroup(2, timeout=5.0)

    def body(comm: Communicator) -> Any:
        with _bulk.bulk_transport(comm, "nccl", 5.0):
            return "entered"

    results = run_ranks(group, body)
    assert all(isinstance(r, CommError) for r in results), results
    assert [m.closed for m in made] == [True]


def test_a_timed_out_thread_rank_is_a_collective_timeout() -> None:
    group = ThreadGroup(2, timeout=0.2)
    got = in_thread(lambda: group.comm(0).allgather_object(1))
    assert isinstance(got, CollectiveTimeout)


class _FakeRequest:
    def __init__(self, test: Callable[[], bool]) -> None:
        self._test = test
        self.cancelled = False

    def Test(self) -> bool:
        return self._test()

    def Cancel(self) -> None:
        self.cancelled = True

    def Wait(self) -> None:
        return None


class _FakeMPI:
    """The little of mpi4py the arrival check uses: rank 0 of two, whose peer answered
    its ready with ``arrival(ready)`` and then stopped, so that a send to it never
    completes."""

    BYTE = "B"
    Exception = RuntimeError

    class Request:
        @staticmethod
        def Testall(requests: list[_FakeRequest]) -> bool:
            return all(r.Test() for r in requests)

    def __init__(self, arrival: Callable[[bytes], bytes]) -> None:
        self.arrival = arrival
        self.sends: list[tuple[bytes, _FakeRequest]] = []

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def Irecv(self, message: list[Any], source: int, tag: int) -> _FakeRequest:
        answer = self.arrival(self.sends[0][0])  # to the ready sent on entering
        message[0][:len(answer)] = answer
        return _FakeRequest(lambda: True)

    def Isend(self, message: list[Any], dest: int, tag: int) -> _FakeRequest:
        request = _FakeRequest(lambda: False)
        self.sends.append((bytes(message[0]), request))
        return request


def test_the_arrival_check_cancels_the_sends_a_stopped_rank_never_took() -> None:
    from distcache.comm._arrival import _LEFT, NODE_KEY_BYTES, _arrive

    # Rank 1 answers the ready with a whole arrival (its nonce, a minute left), then
    # takes nothing more: the word to go is sent and never taken.
    base = _FakeMPI(lambda ready: b"a" + ready[1:] + _LEFT.pack(60.0) + bytes(NODE_KEY_BYTES))
    got = in_thread(lambda: _arrive(base, base, 0.2))
    assert isinstance(got, CollectiveTimeout)
    assert "before taking its word to go" in str(got)
    assert [m[:1] for m, _ in base.sends] == [b"r", b"g"]
    assert all(r.cancelled for _, r in base.sends)


@pytest.mark.parametrize("bad", [
    "not a number",  # combine raises on the node leader
    1 << 255,        # the node's partial sum is wider than the wire allows
])
def test_a_reduction_that_fails_on_a_leader_fails_alike_on_every_rank(bad: Any) -> None:
    group = ThreadGroup(4, ["a", "a", "b", "b"], timeout=3.0)

    def body(comm: Communicator) -> Any:
        tree = NodeTree(comm)
        mine = bad if comm.rank == 1 else (1 << 255 if isinstance(bad, int) else 1)
        return tree.allreduce_object(mine, sum)

    began = time.monotonic()
    results = run_ranks(group, body)
    assert all(isinstance(r, WireError) for r in results), results
    assert time.monotonic() - began < 2.0  # no rank waited out its timeout


def test_two_views_of_one_thread_rank_split_in_step_with_the_others() -> None:
    group = ThreadGroup(2, timeout=2.0)

    def body(comm: Communicator) -> list[Any]:
        again = group.comm(comm.rank) if comm.rank == 0 else comm
        first = comm.split(0).allgather_object(comm.rank)
        return [first, again.split(0).allgather_object(comm.rank)]

    assert run_ranks(group, body) == [[[0, 1], [0, 1]]] * 2
