"""comm.adopt: the one choice of communicator, tested as the pure policy it is."""

from __future__ import annotations

import sys

import pytest

from distcache.comm import adopt
from distcache.comm._local import LocalCommunicator
from distcache.comm.adopt import Adopted, choose
from launch import detect

OPENMPI_4 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
OPENMPI_1 = {
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
}
TORCHRUN_2 = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.fixture(autouse=True)
def _no_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    # The policy looks at sys.modules: neither torch nor mpi4py is "already up" here.
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)


def test_a_multi_rank_mpi_launch_uses_a_duplicate_of_the_mpi_world() -> None:
    assert choose(detect(OPENMPI_4)) == "mpi"


def test_a_world_of_one_starts_no_runtime() -> None:
    assert choose(detect({})) == "local"
    assert choose(detect(OPENMPI_1)) == "local"


def test_an_already_imported_mpi4py_is_used_by_a_single_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())
    assert choose(detect({})) == "mpi"
    # Under torchrun the MPI singleton is not the job's world.
    assert choose(detect(TORCHRUN_2)) == "gloo"


def test_torchrun_gets_a_private_gloo_group_whether_or_not_the_engine_made_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert choose(detect(TORCHRUN_2)) == "gloo"

    class _Dist:
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def is_initialized() -> bool:
            return True

    class _Torch:
        distributed = _Dist

    monkeypatch.setitem(sys.modules, "torch", _Torch)
    # The engine's default group exists: still distcache's own group, never that one.
    assert choose(detect(TORCHRUN_2)) == "gloo"
    assert choose(detect({})) == "gloo"


def test_adopt_alone_gives_a_local_communicator() -> None:
    adopted = adopt(environ={}, node_id="n7")
    assert isinstance(adopted, Adopted)
    assert isinstance(adopted.comm, LocalCommunicator)
    assert (adopted.choice, adopted.rendezvous, adopted.comm.node_id) == ("local", "", "n7")
    adopted.close()
    adopted.close()


def test_adopt_rejects_unknown_options() -> None:
    with pytest.raises(TypeError, match="unknown option"):
        adopt(environ={}, colour="blue")
