"""comm.adopt: the one choice of communicator, tested as the pure policy it is, and the
run scope every adoption agrees on."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from distcache.comm import adopt
from distcache.comm._local import LocalCommunicator
from distcache.comm._scope import job_root
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


def test_every_adoption_has_a_scope_whose_secret_is_never_shown() -> None:
    first, second = adopt(environ={}), adopt(environ={})
    for scope in (first.scope, second.scope):
        assert re.fullmatch(r"[0-9a-f]{32}", scope.nonce) and len(scope.secret) == 32
        assert scope.secret.hex() not in repr(scope) and "secret" not in repr(scope)
        assert scope.prefix.startswith("distcache/") and scope.prefix.endswith(scope.nonce)
    assert first.scope.nonce != second.scope.nonce
    assert first.scope.secret != second.scope.secret


def test_the_scope_names_the_launchers_job_and_attempt() -> None:
    env = {**TORCHRUN_2, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "3"}
    scope = adopt(environ=env).scope
    assert (scope.job, scope.attempt) == ("torchrun:job-a", 3)
    assert scope.prefix == f"{job_root('torchrun:job-a')}/{scope.nonce}"
    # Jobs never share a prefix (attempts are told apart by the nonce: test_comm_meet).
    assert len({job_root(job) for job in ("a", "b", "")}) == 3


_MISMATCH_PROGRAM = """
from distcache.comm import adopt
from distcache.errors import LaunchError
try:
    adopted = adopt(timeout=10)
except LaunchError as exc:
    print("LaunchError:", exc)
else:
    print("adopted", adopted.choice, adopted.comm.rank, adopted.comm.size)
    adopted.close()
"""


def test_an_mpi_world_that_contradicts_the_launcher_is_refused() -> None:
    # Hydra's variables, while mpi4py's own MPI starts this process as a singleton:
    # the MPI world is rank 0 of 1 where the launcher says rank 1 of 2.
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "RANK", "WORLD_SIZE"))}
    env.update({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    done = subprocess.run([sys.executable, "-c", _MISMATCH_PROGRAM], env=env, text=True,
                          capture_output=True, timeout=120)
    assert "LaunchError:" in done.stdout, done.stdout + done.stderr
    assert "rank 1 of 2 (mpich)" in done.stdout and "MPI says rank 0 of 1" in done.stdout
