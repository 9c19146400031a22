"""The Communicator protocol on a real backend, under ``mpirun -n N``.

Every body runs unchanged on MPI and on torch.distributed (``DISTCACHE_TEST_COMM``).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.comm import Communicator, agree_on_error
from distcache.comm._base import lend_broadcast
from distcache.errors import CollectiveTimeout, CommError, IntegrityError, RemoteError, WireError

pytestmark = pytest.mark.mpi(min_size=2)

MiB = 1 << 20


def _payload(root: int, size: int) -> bytes:
    return bytes((root * 7 + i) % 251 for i in range(256)) * (size // 256) + bytes(size % 256)


def test_communicator_implements_the_protocol_for_the_selected_backend(comm: Communicator) -> None:
    assert isinstance(comm, Communicator)
    # torch: distcache's own gloo group, never the default group it sits beside.
    expected = {"mpi": "mpi", "torch": "gloo"}[os.environ.get("DISTCACHE_TEST_COMM", "mpi")]
    assert comm.backend == expected
    assert comm.allgather_object(comm.rank) == list(range(comm.size))


def test_broadcast_delivers_root_bytes_from_every_root(comm: Communicator) -> None:
    for root in range(comm.size):
        sent = _payload(root, 1000 + root)
        got = comm.broadcast_bytes(sent if comm.rank == root else None, root)
        assert got == sent


def test_broadcast_of_empty_payload_returns_empty_bytes(comm: Communicator) -> None:
    got = comm.broadcast_bytes(b"" if comm.rank == 0 else None, 0)
    assert got == b""


def test_broadcast_larger_than_chunk_is_split_into_chunk_messages(
    comm_factory: Callable[..., Communicator],
) -> None:
    small = comm_factory(chunk_bytes=1 * MiB)
    root = small.size - 1
    sent = _payload(root, 5 * MiB + 3)
    before = small.chunk_messages  # type: ignore[attr-defined]
    got = small.broadcast_bytes(sent if small.rank == root else None, root)
    assert got == sent
    assert small.chunk_messages - before == 6  # type: ignore[attr-defined]


def test_broadcast_of_exact_multiple_of_chunk_sends_no_empty_tail(
    comm_factory: Callable[..., Communicator],
) -> None:
    small = comm_factory(chunk_bytes=1 * MiB)
    sent = _payload(0, 2 * MiB)
    before = small.chunk_messages  # type: ignore[attr-defined]
    assert small.broadcast_bytes(sent if small.rank == 0 else None, 0) == sent
    assert small.chunk_messages - before == 2  # type: ignore[attr-defined]


def test_lent_broadcast_sends_the_roots_buffer_in_place_and_gives_receivers_their_own(
    comm_factory: Callable[..., Communicator],
) -> None:
    small = comm_factory(chunk_bytes=1 * MiB)
    root = small.size - 1
    sent = bytearray(_payload(root, 3 * MiB + 5))
    got = lend_broadcast(small, sent if small.rank == root else None, root)
    assert got == sent
    if small.rank == root:
        assert got is sent  # lent, not copied
    else:
        # A buffer of this rank's own: changing it changes nobody else's.
        assert isinstance(got, bytes | bytearray)
        if isinstance(got, bytearray):
            got[0] ^= 0xFF
    assert small.broadcast_bytes(b"after" if small.rank == 0 else None, 0) == b"after"
    # Plain broadcast_bytes still returns bytes, also from a lent-capable transport.
    assert type(small.broadcast_bytes(bytes(sent) if small.rank == 0 else None, 0)) is bytes


def test_broadcast_rejects_bad_root_and_missing_data_before_communicating(
    comm: Communicator,
) -> None:
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast_bytes(b"x", comm.size)
    if comm.rank == 0:
        with pytest.raises(ValueError, match="root rank must pass data"):
            comm.broadcast_bytes(None, 0)
    comm.barrier()


def test_allgather_object_returns_every_rank_object_in_rank_order(comm: Communicator) -> None:
    mine = {"rank": comm.rank, "blob": b"x" * (comm.rank * 10_000), "none": None}
    gathered = comm.allgather_object(mine)
    assert [g["rank"] for g in gathered] == list(range(comm.size))
    assert [len(g["blob"]) for g in gathered] == [r * 10_000 for r in range(comm.size)]


class _Marker:
    """Unpickling this creates ``path``: proof that a payload's code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_a_pickle_sent_in_place_of_a_payload_is_refused_on_every_rank_and_never_runs(
    comm_factory: Callable[..., Communicator], shared_tmp: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fresh: Any = comm_factory()
    marker = shared_tmp / "payload-code-ran"
    evil = pickle.dumps({"rank": _Marker(marker)})
    if fresh.rank == 1:
        # Rank 1's transport sends a pickle instead of what rank 1 encoded.
        encoded = fresh._allgather_encoded
        monkeypatch.setattr(fresh, "_allgather_encoded", lambda mine, budget: encoded(evil, budget))
    with pytest.raises(WireError) as info:
        fresh.allgather_object({"rank": fresh.rank})
    assert (info.value.peer, info.value.rank) == (1, fresh.rank)  # type: ignore[attr-defined]
    assert "a pickle?" in str(info.value)
    monkeypatch.undo()
    fresh.barrier()
    assert not marker.exists()
    # The collective itself completed: the communicator carries on.
    assert fresh.allgather_object(fresh.rank) == list(range(fresh.size))
    fresh.close()


def test_a_value_that_is_not_plain_data_is_refused_on_the_sender(comm: Communicator) -> None:
    @dataclasses.dataclass
    class Report:
        rank: int

    with pytest.raises(WireError, match="Report"):
        comm.allgather_object(Report(comm.rank))
    assert comm.allgather_object(dataclasses.asdict(Report(comm.rank))) == [
        {"rank": r} for r in range(comm.size)]


def test_split_by_parity_gives_each_parity_its_own_communicator(comm: Communicator) -> None:
    sub = comm.split(comm.rank % 2)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert sub.size == len(members)
    assert sub.rank == members.index(comm.rank)
    assert sub.node_id == comm.node_id
    assert sub.allgather_object(comm.rank) == members
    sent = f"parity {comm.rank % 2}".encode()
    assert sub.broadcast_bytes(sent if sub.rank == 0 else None, 0) == sent


def test_split_by_node_groups_ranks_that_share_a_node(comm: Communicator) -> None:
    nodes = comm.allgather_object(comm.node_id)
    color = sorted(set(nodes)).index(comm.node_id)
    sub = comm.split(color)
    assert sub.size == nodes.count(comm.node_id)
    assert set(sub.allgather_object(sub.node_id)) == {comm.node_id}


def test_split_accepts_negative_colors_and_nests(comm: Communicator) -> None:
    half = comm.split(-1 if comm.rank < comm.size // 2 else 5)
    single = half.split(half.rank)
    assert single.size == 1
    assert single.broadcast_bytes(b"alone", 0) == b"alone"
    assert half.allgather_object(half.rank) == list(range(half.size))


def test_agree_on_error_returns_when_no_rank_failed(comm: Communicator) -> None:
    agree_on_error(comm, None)


def test_distcache_error_on_one_rank_is_raised_on_every_rank(comm: Communicator) -> None:
    failing = comm.size - 1
    error = (
        IntegrityError("digest mismatch for x.cubin", sha256="ab" * 32, actual="cd" * 32)
        if comm.rank == failing
        else None
    )
    with pytest.raises(IntegrityError, match="digest mismatch") as info:
        agree_on_error(comm, error)
    assert info.value.sha256 == "ab" * 32  # type: ignore[attr-defined]
    if comm.rank == failing:
        assert info.value is error


def test_foreign_error_on_one_rank_reaches_others_as_remote_error(comm: Communicator) -> None:
    nodes = comm.allgather_object(comm.node_id)
    if comm.rank == 1:
        with pytest.raises(KeyError):
            agree_on_error(comm, KeyError("missing-key"))
        return
    with pytest.raises(RemoteError, match=r"rank 1/\d+ on .* failed with KeyError") as info:
        agree_on_error(comm, None)
    assert info.value.rank == 1  # type: ignore[attr-defined]
    assert info.value.host == nodes[1]  # type: ignore[attr-defined]
    assert info.value.remote_type == "KeyError"  # type: ignore[attr-defined]


def test_barrier_times_out_when_a_rank_never_arrives_and_world_recovers(
    comm: Communicator,
) -> None:
    # A fresh sub-communicator takes the damage: a timed-out collective cannot be
    # cancelled, so the communicator it ran on is retired.
    doomed = comm.split(0)
    late = comm.size - 1
    if comm.rank != late:
        with pytest.raises(CollectiveTimeout) as info:
            doomed.barrier(timeout=0.5)
        assert isinstance(info.value, TimeoutError)
        assert info.value.op == "barrier"  # type: ignore[attr-defined]
        assert info.value.timeout == 0.5  # type: ignore[attr-defined]
        assert info.value.rank == comm.rank  # type: ignore[attr-defined]
        with pytest.raises(CommError, match="unusable"):
            doomed.barrier(timeout=0.5)
    comm.barrier()
    if comm.rank == late:
        # Arriving late completes the collective its peers abandoned, so nothing is
        # left pending in the backend.
        doomed.barrier(timeout=60)
    comm.barrier()
    assert comm.allgather_object(comm.rank) == list(range(comm.size))


def test_groups_made_by_split_stay_bounded_however_many_partitions_a_job_sees(
    comm_factory: Callable[..., Communicator],
) -> None:
    from distcache.comm._backend import MAX_CHILDREN, BackendCommunicator

    fresh = comm_factory()
    assert isinstance(fresh, BackendCommunicator)
    partitions = 3 * MAX_CHILDREN
    # Every call has colors no earlier call had (as when a job's audiences keep
    # changing), so each one makes a group.
    for p in range(partitions):
        child = fresh.split(10 * p + fresh.rank % 2)
        assert child.allgather_object(fresh.rank) == [
            r for r in range(fresh.size) if r % 2 == fresh.rank % 2
        ]
    kept = fresh._children
    assert fresh.groups_made == partitions
    assert len(kept) <= MAX_CHILDREN
    # The partition used last is kept and handed out again without making a group.
    again = fresh.split(10 * (partitions - 1) + fresh.rank % 2)
    assert again is list(kept.values())[-1]
    assert fresh.groups_made == partitions
    # An evicted child was closed: it refuses further use.
    fresh.close()
    with pytest.raises(CommError):
        again.barrier()


def test_a_rank_missing_from_the_arrival_tree_times_out_its_peers_and_leaves_nothing_behind(
) -> None:
    # The MPI backend's check, run under either test communicator: mpirun started
    # these ranks, so MPI is there.
    from mpi4py import MPI

    from distcache.comm._arrival import _arrival_tree
    from distcache.comm._mpi import MpiCommunicator

    base = MPI.COMM_WORLD.Dup()
    try:
        late = base.Get_size() - 1
        if base.Get_rank() != late:
            with pytest.raises(CollectiveTimeout, match="did not arrive") as info:
                MpiCommunicator(base, timeout=1.0)
            assert info.value.rank == base.Get_rank()  # type: ignore[attr-defined]
            if base.Get_rank() == _arrival_tree(late, base.Get_size())[0]:
                # The late rank's parent in the tree names it.
                assert f"rank(s) {late} did not arrive" in str(info.value)
        base.Barrier()
        # Every receive of the failed check was cancelled: the next check on the same
        # base matches only its own messages, and the duplicate works.
        again = MpiCommunicator(base, timeout=60)
        assert again.allgather_object(again.rank) == list(range(again.size))
        again.close()
    finally:
        base.Free()


def test_a_rank_that_never_makes_the_node_tree_times_out_its_peers_instead_of_blocking(
) -> None:
    # The node ids come with MPI's arrival check, so the tree gathers none of its own;
    # a rank that failed after the communicator was made must still not leave its
    # node's other ranks blocked in making their node's group (which has no timeout).
    from mpi4py import MPI

    from distcache.comm._mpi import MpiCommunicator
    from distcache.comm._tree import NodeTree

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    made = MpiCommunicator(timeout=60, node_id=f"n{rank // 2}")
    late = size - 1
    try:
        assert made.node_keys() is not None
        if rank != late:
            with pytest.raises(CollectiveTimeout) as info:
                NodeTree(made, timeout=1.0)
            assert info.value.op == "barrier"  # type: ignore[attr-defined]
        MPI.COMM_WORLD.Barrier()
        if rank == late:
            made.barrier(timeout=60)  # completes the barrier its peers abandoned
    finally:
        made.close()
    MPI.COMM_WORLD.Barrier()


def _count_rounds(fresh: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the transport's primitives that ``fresh`` calls from now on."""
    counts = {"_allgather_blocks": 0, "_allgather_payloads": 0, "_broadcast_block": 0,
              "_broadcast_span": 0}

    def counting(name: str, inner: Any) -> Any:
        def counted(*args: Any) -> Any:
            counts[name] += 1
            return inner(*args)

        return counted

    for name in counts:
        monkeypatch.setattr(fresh, name, counting(name, getattr(fresh, name)))
    return counts


@pytest.fixture
def rounds(comm_factory: Callable[..., Communicator], monkeypatch: pytest.MonkeyPatch,
           ) -> Iterator[tuple[Any, dict[str, int], int]]:
    """A fresh communicator, the counts of its transport calls, and its heads' width."""
    from distcache.comm._inline import inline_width

    fresh: Any = comm_factory()
    yield fresh, _count_rounds(fresh, monkeypatch), inline_width(fresh.size)
    monkeypatch.undo()
    fresh.close()


def test_small_payloads_are_gathered_and_broadcast_in_one_round(
    rounds: tuple[Any, dict[str, int], int],
) -> None:
    fresh, counts, width = rounds
    # Every rank's encoded payload fits its head: the lengths and the payloads are one
    # all-gather, and no second round follows.
    objects = [b"", b"x" * (width // 2), {"rank": 1, "names": ["a", "b"]}, None]
    mine = objects[fresh.rank % len(objects)]
    assert fresh.allgather_object(mine) == [objects[r % len(objects)] for r in range(fresh.size)]
    assert (counts["_allgather_blocks"], counts["_allgather_payloads"]) == (1, 0)
    sent = _payload(1, 1000)
    assert fresh.broadcast_bytes(sent if fresh.rank == 1 else None, 1) == sent
    assert fresh.broadcast_bytes(b"" if fresh.rank == 0 else None, 0) == b""
    assert (counts["_broadcast_block"], counts["_broadcast_span"]) == (2, 0)


def test_a_payload_past_its_head_takes_a_second_round_on_every_rank_and_arrives_whole(
    rounds: tuple[Any, dict[str, int], int],
) -> None:
    from distcache.comm._codec import encode

    fresh, counts, width = rounds

    def encoded_as(target: int) -> int:
        """The length of a bytes value whose encoded form is ``target`` bytes."""
        n = target
        while len(encode(bytes(n))) > target:
            n -= 1
        return n

    # Encoded lengths of exactly the width, one past it, several times it, and empty.
    sizes = [encoded_as(width), encoded_as(width) + 1, 3 * width + 17, 0]
    objects = [_payload(r, sizes[r % len(sizes)]) for r in range(fresh.size)]
    assert len(encode(objects[0])) == width and len(encode(objects[1])) == width + 1
    assert fresh.allgather_object(objects[fresh.rank]) == objects
    assert (counts["_allgather_blocks"], counts["_allgather_payloads"]) == (1, 1)
    # A broadcast longer than its head goes whole through the chunks.
    sent = _payload(0, 3 * width)
    assert fresh.broadcast_bytes(sent if fresh.rank == 0 else None, 0) == sent
    assert (counts["_broadcast_block"], counts["_broadcast_span"]) == (1, 1)


def test_rank_0s_announcement_reaches_every_rank_with_the_arrival_check(
        comm: Communicator) -> None:
    if os.environ.get("DISTCACHE_TEST_COMM", "mpi") != "mpi":
        pytest.skip("the arrival check is the MPI communicator's")
    from distcache.comm import MpiCommunicator
    from distcache.comm._arrival import node_key
    from distcache.comm._tree import NodeTree
    from distcache.comm.adopt import adopt

    mine = bytes([comm.rank]) * 48  # each rank passes its own; rank 0's must win
    made = MpiCommunicator(announce=mine, timeout=60, node_id=f"n{comm.rank // 2}")
    try:
        assert made.announced == bytes(48)
        # Every rank's node came with it, in rank order: the node tree needs no
        # all-gather of its own and groups the ranks by it.
        assert made.node_keys() == [node_key(f"n{r // 2}") for r in range(comm.size)]
        tree = NodeTree(made, timeout=60)
        assert tree.nodes == (comm.size + 1) // 2 and tree.leader == comm.rank // 2 * 2
        # A communicator made off it knows its ranks' nodes too: the node tree of the
        # leaders' communicator, or of a split, needs no all-gather either.
        evens = [r for r in range(comm.size) if r % 2 == 0]
        if comm.rank in evens:
            group = made.group_owned(evens)
            assert group.node_keys() == [node_key(f"n{r // 2}") for r in evens]
        half = made.split(comm.rank % 2)
        assert half.node_keys() == [node_key(f"n{r // 2}") for r in range(comm.size)
                                    if r % 2 == comm.rank % 2]
        calls = {"n": 0}
        gather = half.allgather_object

        def counted(obj: object, **kw: object) -> list[object]:
            calls["n"] += 1
            return gather(obj, **kw)  # type: ignore[arg-type]

        half.allgather_object = counted  # type: ignore[method-assign]
        NodeTree(half, timeout=60)
        assert calls["n"] == 0
    finally:
        made.close()
    # The run scope an MPI adoption agrees on travels the same way: one on every rank,
    # a fresh one per adoption.
    scopes = []
    for _ in range(2):
        adopted = adopt(timeout=60)
        try:
            scope = adopted.scope
            assert comm.allgather_object((scope.nonce, scope.secret)) == [
                (scope.nonce, scope.secret)] * comm.size
            scopes.append(scope.nonce)
        finally:
            adopted.close()
    assert scopes[0] != scopes[1]
