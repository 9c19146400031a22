"""launch.detect() where one launcher runs inside another, and on the program that
``python -m launch`` starts."""

from __future__ import annotations

import pytest

from launch import detect
from launch.__main__ import child_environment


def _uneven_step(procid: int, localid: int, nodeid: int) -> dict[str, str]:
    """``srun -N2 -n3``: two tasks on the first node, one on the second."""
    return {
        "SLURM_JOB_ID": "500",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_TASKS_PER_NODE": "2,1",
    }


@pytest.mark.parametrize(("procid", "localid", "nodeid"), [(0, 0, 0), (1, 1, 0), (2, 0, 1)])
def test_program_under_the_wrapper_in_an_uneven_srun_step_sees_the_step(
    procid: int, localid: int, nodeid: int
) -> None:
    step = _uneven_step(procid, localid, nodeid)
    wrapper = detect(step, hostname=f"n{nodeid + 1}")
    program = detect(child_environment(wrapper, step, {}), hostname=f"n{nodeid + 1}")
    assert (program.rank, program.world_size) == (procid, 3)
    assert (program.local_rank, program.local_world_size) == (localid, 2 - nodeid)
    assert (program.node_rank, program.num_nodes) == (nodeid, 2)


def test_torchrun_agent_still_gives_the_node_count_from_the_sizes() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert detect(env, hostname="h").num_nodes == 2
    del env["TORCHELASTIC_RUN_ID"]
    assert detect(env, hostname="h").num_nodes is None



def _daemon_step(node: int) -> dict[str, str]:
    """The step ``mpirun`` in a two-node allocation starts its daemons with, as a rank
    on ``node`` inherits it: one task per node."""
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(node),
            "SLURM_NODEID": str(node), "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


def _openmpi(rank: int, size: int, local_rank: int, local_size: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "PMIX_RANK": str(rank),
            "PMIX_NAMESPACE": "prterun-n1-1@1"}


def test_mpirun_ranks_on_one_node_of_an_allocation_ignore_the_daemon_step_alike() -> None:
    # mpirun -np 2 with both ranks on the first node: rank 0's step happens to agree on
    # rank and size, rank 1's does not; both must come out the same way.
    infos = [detect({**_daemon_step(0), **_openmpi(r, 2, r, 2)}, hostname="n1") for r in (0, 1)]
    assert [(i.launcher, i.rank, i.world_size) for i in infos] == [("openmpi", 0, 2),
                                                                   ("openmpi", 1, 2)]
    assert {(i.local_world_size, i.node_rank, i.num_nodes) for i in infos} == {(2, 0, 1)}
    assert not any(v.startswith("SLURM_") for i in infos for v in i.source)


def test_mpirun_ranks_one_per_node_take_nothing_from_the_daemon_step() -> None:
    infos = [detect({**_daemon_step(r), **_openmpi(r, 2, 0, 1)}, hostname=f"n{r + 1}")
             for r in (0, 1)]
    assert [(i.rank, i.local_rank, i.local_world_size) for i in infos] == [(0, 0, 1), (1, 0, 1)]
    assert {(i.node_rank, i.num_nodes) for i in infos} == {(None, None)}


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_the_program_of_the_wrapper_under_mpirun_in_an_allocation_ignores_the_daemon_step(
    rank: int,
) -> None:
    env = {**_daemon_step(rank // 2), **_openmpi(rank, 4, rank % 2, 2)}
    wrapper = detect(env, hostname=f"n{rank // 2 + 1}")
    program = detect(child_environment(wrapper.replace(master_addr="n1", master_port=4000),
                                       env, {}), hostname=f"n{rank // 2 + 1}")
    assert (program.rank, program.world_size, program.local_rank) == (rank, 4, rank % 2)


def test_a_step_beside_pmi2_that_differs_only_in_a_local_field_is_not_this_step() -> None:
    # srun --mpi=pmi2 sets PMI_* beside its own step; Hydra's proxies started by srun
    # leave their step to ranks that may match it on rank and size by chance.
    env = {**_daemon_step(0), "PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0",
           "MPI_LOCALNRANKS": "2"}
    info = detect(env, hostname="n1")
    assert (info.launcher, info.local_world_size, info.num_nodes) == ("mpich", 2, 1)
    real_step = {**env, "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1",
                 "SLURM_STEP_NODELIST": "n1"}
    assert "SLURM_NODEID" in detect(real_step, hostname="n1").source
    assert "SLURM_NODEID" not in info.source


_TORCHRUN_WORKER = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
                    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize("rank", [0, 1])
def test_mpirun_inside_a_torchrun_worker_is_warned_about(
    rank: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("launch._detect._WARNED", set())
    env = {**_TORCHRUN_WORKER, **_openmpi(rank, 2, rank, 2)}
    with caplog.at_level("WARNING", logger="launch._detect"):
        info = detect(env, hostname="h")
        detect(env, hostname="h")
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 0, 1)
    warnings = [r.getMessage() for r in caplog.records if r.name == "launch._detect"]
    assert len(warnings) == 1, warnings
    assert "OMPI_COMM_WORLD_SIZE=2 (openmpi) is larger than WORLD_SIZE=1" in warnings[0]
    assert f"not as openmpi rank {rank} of 2" in warnings[0]


def test_torchrun_inside_srun_is_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("launch._detect._WARNED", set())
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none",
           "MASTER_ADDR": "n1", "MASTER_PORT": "29500", **_daemon_step(1)}
    with caplog.at_level("WARNING", logger="launch._detect"):
        assert detect(env, hostname="n2").rank == 3
    assert not [r for r in caplog.records if r.name == "launch._detect"]
