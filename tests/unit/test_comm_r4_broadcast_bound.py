"""A broadcast's receivers bound the length the root announces: past the caller's
``max_bytes`` (or the default cap) every rank raises a WireError naming both sizes,
before any rank allocates for it, and no rank is left waiting for chunks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Self

import pytest

from distcache.comm import ThreadGroup
from distcache.comm._backend import BackendCommunicator, Budget
from distcache.errors import WireError

#: A length no host can allocate: a receiver that believes it fails obscurely.
HUGE = 1 << 45


class _Threaded(BackendCommunicator):
    """A backend whose transport is a thread group; the root may forge its head."""

    _kind = "threads-backend"
    _label = "thread"

    def __init__(self, group: ThreadGroup, rank: int, forged: int | None = None,
                 **options: Any) -> None:
        super().__init__(**options)
        self._group, self._forged = group, forged
        self._rank, self._size = rank, group.size

    def _swap(self, obj: Any, budget: Budget) -> list[Any]:
        wait = max(0.001, budget.until - time.monotonic())
        return self._group._exchange(self._rank, obj, "broadcast_bytes", wait)

    def _broadcast_block(self, block: bytes | None, width: int, root: int,
                         budget: Budget) -> bytes:
        if block is not None and self._forged is not None:
            block = self._forged.to_bytes(8, "little") + block[8:]
        got: bytes = self._swap(block, budget)[root]
        return got

    def _payload_buffer(self, data: bytes | None, total: int) -> bytearray:
        return bytearray(data) if data is not None else bytearray(total)

    def _broadcast_span(self, buffer: bytearray, start: int, stop: int, root: int,
                        budget: Budget) -> None:
        mine = bytes(buffer[start:stop]) if self._rank == root else None
        buffer[start:stop] = self._swap(mine, budget)[root]

    def _buffer_bytes(self, buffer: bytearray) -> bytes:
        return bytes(buffer)

    def _allgather_blocks(self, block: bytes, budget: Budget) -> list[Any]:
        return self._swap(block, budget)

    def _allgather_payloads(self, mine: bytes, lengths: list[int],
                            budget: Budget) -> list[Any]:
        return self._swap(mine, budget)

    def _barrier(self, budget: Budget) -> None:
        self._swap(None, budget)

    def _split_child(self, colors: tuple[int, ...], color: int) -> Self:
        raise NotImplementedError


def _run(size: int, body: Callable[[_Threaded], Any], *, forged: int | None = None,
         **options: Any) -> tuple[list[Any], list[_Threaded]]:
    """``body`` on every rank of a thread-backed group (rank 0 forging its head when
    ``forged``); every result or raised error, and the communicators. Fails the test
    when a rank is still running after 20 s (the group's own timeout is 10 s)."""
    group = ThreadGroup(size, timeout=10.0)
    comms = [_Threaded(group, r, forged if r == 0 else None, timeout=10.0, **options)
             for r in range(size)]
    results: list[Any] = [None] * size

    def one(rank: int) -> None:
        try:
            results[rank] = body(comms[rank])
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20.0)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, comms


@pytest.mark.parametrize("lend", [False, True])
def test_a_forged_length_is_refused_on_every_rank_under_the_default_cap(lend: bool) -> None:
    def body(comm: _Threaded) -> Any:
        data = b"x" * 5000 if comm.rank == 0 else None
        if lend:
            return comm.broadcast_buffer(None if data is None else bytearray(data), 0)
        return comm.broadcast_bytes(data, 0)

    results, comms = _run(3, body, forged=HUGE)
    for rank, got in enumerate(results):
        assert isinstance(got, WireError), (rank, got)
        assert str(HUGE) in str(got)
        if lend:  # bulk data: bounded by what the host could hold at all
            assert "this host's memory" in str(got)
        else:
            assert str(comms[rank].max_broadcast_bytes) in str(got)
            assert "DISTCACHE_MAX_ARTIFACT_BYTES" in str(got)
        assert getattr(got, "peer", None) == 0 and getattr(got, "rank", None) == rank
    assert not any(c.usable for c in comms)  # the root may have sent chunks: out of step
    assert all(c.payload_bytes == 0 and c.chunk_messages == 0 for c in comms)


@pytest.mark.parametrize("lend", [False, True])
def test_max_bytes_bounds_a_broadcast_on_every_rank_the_root_included(lend: bool) -> None:
    def body(comm: _Threaded) -> Any:
        data = b"y" * 1000 if comm.rank == 0 else None
        if lend:
            return comm.broadcast_buffer(None if data is None else bytearray(data), 0,
                                         max_bytes=100)
        return comm.broadcast_bytes(data, 0, max_bytes=100)

    results, comms = _run(2, body)
    assert not any(c.usable for c in comms)
    for got in results:
        assert isinstance(got, WireError)
        assert "1000 bytes" in str(got) and "100 this rank accepts" in str(got)
        assert "max_bytes" in str(got)
    assert "this rank, the root" in str(results[0])
    assert "root rank 0 announced" in str(results[1])


def test_a_payload_within_max_bytes_arrives_in_chunks() -> None:
    payload = bytes(range(256)) * 40

    def body(comm: _Threaded) -> Any:
        return comm.broadcast_bytes(payload if comm.rank == 0 else None, 0,
                                    max_bytes=len(payload))

    results, comms = _run(3, body, chunk_bytes=1000)
    assert results == [payload] * 3
    assert all(c.usable and c.chunk_messages == 11 for c in comms)


def test_the_default_cap_follows_the_artifact_and_bucket_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", "3000")
    monkeypatch.setenv("DISTCACHE_BUCKET_BYTES", "1000")

    def body(comm: _Threaded) -> Any:
        return comm.broadcast_bytes(b"z" * 4001 if comm.rank == 0 else None, 0)

    results, comms = _run(2, body)
    assert all(c.max_broadcast_bytes == 4000 for c in comms)
    assert all(isinstance(r, WireError) and "4001" in str(r) and "4000" in str(r)
               for r in results)


@pytest.mark.parametrize("bad", [-1, "100", 1.5, True])
def test_a_bad_max_bytes_is_refused_before_any_rank_communicates(bad: Any) -> None:
    group = ThreadGroup(2, timeout=10.0)
    comm = _Threaded(group, 1, timeout=10.0)
    with pytest.raises(ValueError, match="max_bytes must be a number of bytes"):
        comm.broadcast_bytes(None, 0, max_bytes=bad)
    assert group.calls == [0, 0] and comm.usable


def test_a_gloo_receiver_refuses_a_forged_length_without_waiting() -> None:
    dist = pytest.importorskip("torch.distributed")
    from distcache.comm._gloo import GlooCommunicator

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    results: list[Any] = [None, None]

    def one(rank: int) -> None:
        store = server if rank == 0 else dist.TCPStore(
            "127.0.0.1", server.port, None, False, timedelta(seconds=30))
        try:
            comm = GlooCommunicator(store, rank, 2, run=("bound", 0), timeout=20)
            if rank == 0:  # a corrupt root: its head announces more than it holds
                real = comm._broadcast_block

                def forged(block: bytes | None, width: int, root: int,
                           budget: Budget) -> Any:
                    assert block is not None
                    return real(HUGE.to_bytes(8, "little") + block[8:], width, root, budget)

                comm._broadcast_block = forged  # type: ignore[method-assign]
            results[rank] = comm.broadcast_bytes(b"q" * 5000 if rank == 0 else None, 0)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert isinstance(results[1], WireError), results[1]
    assert str(HUGE) in str(results[1]) and "root rank 0 announced" in str(results[1])
    assert isinstance(results[0], WireError), results[0]


def test_bulk_data_past_the_control_cap_still_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    # An artifact of a known size may be larger than DISTCACHE_MAX_ARTIFACT_BYTES (the
    # cap for one of unknown size): it travels alone, as bulk data, and must arrive.
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", "3000")
    monkeypatch.setenv("DISTCACHE_BUCKET_BYTES", "1000")
    payload = bytes(range(256)) * 40  # 10240 bytes, past the 4000 of the control cap

    def body(comm: _Threaded) -> Any:
        return comm.broadcast_buffer(bytearray(payload) if comm.rank == 0 else None, 0)

    results, comms = _run(3, body, chunk_bytes=1000)
    assert [bytes(r) for r in results] == [payload] * 3
    assert all(c.usable for c in comms)
