"""Bulk bytes on one communicator, control on another (``init(transport="nccl")``).

The composition is checked here with two thread groups standing in for the control
(MPI/gloo) and bulk (NCCL) transports; the NCCL group itself needs GPUs and runs in
``scripts/gpu_check.sh``. Without CUDA, asking for it fails alike on every rank.
"""

from __future__ import annotations

from typing import Any

from distcache.comm import BulkCommunicator, Communicator, ThreadGroup, bulk_transport
from distcache.errors import CommError
from tests.unit.test_comm_local import run_ranks


class Recording:
    """A communicator that notes which of its collectives ran."""

    def __init__(self, inner: Communicator, calls: list[str]) -> None:
        self.inner, self.calls = inner, calls
        self.rank, self.size, self.node_id = inner.rank, inner.size, inner.node_id
        self.backend = inner.backend

    def broadcast_bytes(self, data: bytes | None, root: int, **kw: Any) -> bytes:
        self.calls.append("broadcast_bytes")
        return self.inner.broadcast_bytes(data, root, **kw)

    def allgather_object(self, obj: Any, **kw: Any) -> list[Any]:
        self.calls.append("allgather_object")
        return self.inner.allgather_object(obj, **kw)

    def barrier(self, **kw: Any) -> None:
        self.calls.append("barrier")
        self.inner.barrier(**kw)

    def split(self, color: int) -> Recording:
        self.calls.append("split")
        return Recording(self.inner.split(color), self.calls)


def test_payload_travels_on_bulk_and_agreement_on_control() -> None:
    control, bulk = ThreadGroup(3), ThreadGroup(3)
    control_calls: list[list[str]] = [[], [], []]
    bulk_calls: list[list[str]] = [[], [], []]

    def body(c: Communicator) -> tuple[bytes, list[int], str]:
        pair = BulkCommunicator(Recording(control.comm(c.rank), control_calls[c.rank]),
                                Recording(bulk.comm(c.rank), bulk_calls[c.rank]))
        got = pair.broadcast_bytes(b"x" * 1000 if pair.rank == 1 else None, 1)
        ranks = pair.allgather_object(pair.rank)
        pair.barrier()
        half = pair.split(pair.rank % 2)
        assert isinstance(half, BulkCommunicator)
        again = half.broadcast_bytes(b"y" if half.rank == 0 else None, 0)
        return got + again, ranks, pair.backend

    results = run_ranks(ThreadGroup(3), body)
    assert all(not isinstance(r, BaseException) for r in results), results
    assert [r[0] for r in results] == [b"x" * 1000 + b"y"] * 3
    assert [r[1] for r in results] == [[0, 1, 2]] * 3
    assert {r[2] for r in results} == {"threads+threads"}
    # Payloads went over the bulk transport only; agreement over the control one.
    for rank in range(3):
        assert bulk_calls[rank] == ["broadcast_bytes", "split", "broadcast_bytes"]
        assert control_calls[rank] == ["allgather_object", "barrier", "split"]


def test_the_default_transport_is_the_communicator_itself() -> None:
    group = ThreadGroup(2)

    def body(c: Communicator) -> bool:
        with bulk_transport(c, "default", 10) as moving:
            return moving is c

    assert run_ranks(group, body) == [True, True]


def test_nccl_without_cuda_fails_on_every_rank_with_a_comm_error() -> None:
    group = ThreadGroup(2)

    def body(c: Communicator) -> str:
        try:
            with bulk_transport(c, "nccl", 20):
                return "entered"
        except CommError as exc:
            return str(exc)

    results = run_ranks(group, body)
    assert all("NCCL" in r or "nccl" in r for r in results), results
