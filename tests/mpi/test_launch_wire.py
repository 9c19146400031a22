"""The launcher's MPI exchanges (host names, rank 0's rendezvous address) carry JSON
through mpi4py's buffer calls, never a pickle."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from distcache.errors import CommError
from launch import _mpiwire

pytestmark = pytest.mark.mpi(min_size=2)


def _world():  # type: ignore[no-untyped-def]
    from mpi4py import MPI

    return MPI.COMM_WORLD


def test_host_names_and_the_address_reach_every_rank_in_rank_order() -> None:
    comm = _world()
    rank, size = comm.Get_rank(), comm.Get_size()
    assert _mpiwire.allgather_str(comm, f"host-{rank}-é") == [f"host-{r}-é" for r in range(size)]
    message = ("ok", "10.0.0.1", 29500) if rank == 0 else None
    assert _mpiwire.bcast_message(comm, message) == ("ok", "10.0.0.1", 29500)



def test_a_long_failure_from_rank_0_reaches_every_rank_cut_to_fit() -> None:
    # Rank 0 reaches the broadcast whatever its failure says; a message too long to
    # send would leave the other ranks waiting in it.
    comm = _world()
    text = "no address for the job: " + ", ".join(f"host-{i}" for i in range(2000))
    message = ("error", text, 0) if comm.Get_rank() == 0 else None
    status, said, port = _mpiwire.bcast_message(comm, message)
    assert (status, port) == ("error", 0)
    assert said.startswith("no address for the job: host-0, host-1") and said.endswith("[cut]")
    assert len(said.encode()) <= _mpiwire.MAX_MESSAGE_BYTES

class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def test_a_pickle_from_a_peer_is_a_typed_error_and_never_runs(tmp_path: Path) -> None:
    marker = os.path.join(tmp_path, f"ran-{_world().Get_rank()}")
    payload = pickle.dumps(_Marker(marker))
    with pytest.raises(CommError, match="malformed rendezvous message"):
        _mpiwire._decode(payload, 1)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("payload", [b"[" * 4000, b"\xff\xfe", b'{"a": 1'])
def test_a_malformed_message_from_a_peer_is_a_typed_error(payload: bytes) -> None:
    # Deep nesting makes json raise RecursionError, which is not a ValueError.
    with pytest.raises(CommError, match="rank 1 sent a malformed rendezvous message"):
        _mpiwire._decode(payload, 1)


def test_an_oversized_announcement_is_refused_before_allocating() -> None:
    with pytest.raises(CommError, match="at most"):
        _mpiwire._length(1 << 40, 1)
