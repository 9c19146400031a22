"""launch.detect() against environments captured from real launchers."""

from __future__ import annotations

import pickle
import subprocess
import sys
from unittest.mock import ANY

import pytest

import launch
from distcache.errors import DistcacheError
from launch import LaunchError, LaunchInfo, detect

HOST = "host-under-test"

# torchrun --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29533, rank 1.
TORCHRUN = {
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29533",
    "OMP_NUM_THREADS": "1",
    "RANK": "1",
    "ROLE_NAME": "default",
    "ROLE_RANK": "1",
    "ROLE_WORLD_SIZE": "2",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "WORLD_SIZE": "2",
}

# torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 on the second host, rank 3.
TORCHRUN_TWO_NODES = {
    **TORCHRUN,
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "ROLE_RANK": "3",
    "ROLE_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}

# Open MPI 5 (PRRTE) `mpirun -n 2`, rank 1 (PMIX_RANK is set by Open MPI too).
OPENMPI5 = {
    "OMPI_COMMAND": "python",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_MCA_num_procs": "2",
    "OMPI_UNIVERSE_SIZE": "2",
    "PMIX_NAMESPACE": "prterun-vm-4872@1",
    "PMIX_RANK": "1",
    "PRTE_LAUNCHED": "1",
}

# Open MPI on two hosts, 2 ranks each: rank 2 is the first rank of the second host.
OPENMPI_TWO_HOSTS = {
    **OPENMPI5,
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_NODE_RANK": "0",
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "PMIX_RANK": "2",
}

# MPICH 4 Hydra `mpiexec -n 3`, rank 2.
MPICH_HYDRA = {
    "PMI_RANK": "2",
    "PMI_SIZE": "3",
    "PMI_FD": "7",
    "MPI_LOCALRANKID": "2",
    "MPI_LOCALNRANKS": "3",
    "HYDI_CONTROL_FD": "9",
    "MPIR_CVAR_CH3_INTERFACE_HOSTNAME": "node7",
}

# Old Hydra gives PMI_ID instead of PMI_RANK (pmodels/mpich#988).
MPICH_OLD_HYDRA = {"PMI_ID": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}

# Intel MPI `mpirun -n 4 -ppn 2` on two hosts, rank 3.
INTEL_MPI = {
    "PMI_RANK": "3",
    "PMI_SIZE": "4",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "2",
    "I_MPI_HYDRA_TOPOLIB": "hwloc",
    "I_MPI_ROOT": "/opt/intel/oneapi/mpi/latest",
}

# srun -n 3 on the one-node cluster of scripts/slurm_up.sh, rank 1 (captured).
SLURM_ONE_NODE = {
    "SLURMD_NODENAME": "vm",
    "SLURM_CLUSTER_NAME": "distcache",
    "SLURM_CPUS_ON_NODE": "3",
    "SLURM_GTIDS": "0,1,2",
    "SLURM_JOBID": "1",
    "SLURM_JOB_ID": "1",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
    "SLURM_LOCALID": "1",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "vm",
    "SLURM_NPROCS": "3",
    "SLURM_NTASKS": "3",
    "SLURM_PROCID": "1",
    "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "3",
    "SLURM_TASKS_PER_NODE": "3",
}

# srun -n 7 over 3 nodes (block distribution 3,2,2) of a 4-node allocation; rank 4 is
# the second task of the second node. The job list has a node the step does not use.
SLURM_THREE_NODES = {
    "SLURM_JOB_ID": "48213",
    "SLURM_JOB_NODELIST": "gpu[007-009],cpu-a[1-2]b[3]",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NNODES": "3",
    "SLURM_NTASKS": "7",
    "SLURM_PROCID": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "2",
    "SLURM_STEP_NODELIST": "gpu[008-009],cpu-a1b3",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)",
}

# An sbatch script: job-level variables, no step (captured with `sbatch --wrap env`).
SBATCH_SCRIPT = {
    "SLURM_JOB_ID": "2",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_NNODES": "1",
    "SLURM_TASKS_PER_NODE": "1",
}

# srun --mpi=pmix -n 2: PMIx rank plus the Slurm step.
SLURM_PMIX = {
    **{k: v for k, v in SLURM_ONE_NODE.items()},
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "2",
    "PMIX_RANK": "2",
    "PMIX_NAMESPACE": "slurm.pmix.1.0",
}

# srun --mpi=pmi2: PMI_RANK/PMI_SIZE plus the Slurm step.
SLURM_PMI2 = {**SLURM_ONE_NODE, "PMI_RANK": "1", "PMI_SIZE": "3", "PMI_FD": "5"}

# mpirun inside an sbatch allocation of 2 nodes: the ranks inherit the step that
# started Open MPI's daemons (one task per node), which is not theirs.
OPENMPI_IN_ALLOCATION = {
    **OPENMPI_TWO_HOSTS,
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}

# srun -N 2 --ntasks-per-node 1 torchrun --nproc-per-node 2 ...: a worker on node 1.
TORCHRUN_IN_SRUN = {
    **TORCHRUN_TWO_NODES,
    "SLURM_JOB_ID": "91",
    "SLURM_PROCID": "1",
    "SLURM_NODEID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}

# What `python -m launch` exports under mpirun: agrees with Open MPI's variables.
LAUNCH_UNDER_OPENMPI = {
    **OPENMPI5,
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "41234",
}

# Under MPI the rendezvous address is agreed at run time, so it is None here; for
# Slurm the port is derived from the job id (its value is tested separately).
F = (
    "launcher",
    "rank",
    "world_size",
    "local_rank",
    "local_world_size",
    "node_rank",
    "num_nodes",
    "master_addr",
    "master_port",
)

CASES = {
    "torchrun": (TORCHRUN, ("torchrun", 1, 2, 1, 2, 0, 1, "127.0.0.1", 29533)),
    "torchrun-two-nodes": (TORCHRUN_TWO_NODES, ("torchrun", 3, 4, 1, 2, 1, 2, "10.0.0.1", 29500)),
    "openmpi5": (OPENMPI5, ("openmpi", 1, 2, 1, 2, 0, 1, None, None)),
    "openmpi-two-hosts": (OPENMPI_TWO_HOSTS, ("openmpi", 2, 4, 0, 2, None, None, None, None)),
    "mpich-hydra": (MPICH_HYDRA, ("mpich", 2, 3, 2, 3, 0, 1, None, None)),
    "mpich-old-hydra": (MPICH_OLD_HYDRA, ("mpich", 1, 2, 1, 2, 0, 1, None, None)),
    "intel-mpi": (INTEL_MPI, ("mpich", 3, 4, 1, 2, None, None, None, None)),
    "slurm-one-node": (SLURM_ONE_NODE, ("slurm", 1, 3, 1, 3, 0, 1, "127.0.0.1", ANY)),
    "slurm-three-nodes": (SLURM_THREE_NODES, ("slurm", 4, 7, 1, 2, 1, 3, "gpu008", ANY)),
    "sbatch-script-is-single": (SBATCH_SCRIPT, ("single", 0, 1, 0, 1, 0, 1, "127.0.0.1", None)),
    "srun-pmix": (SLURM_PMIX, ("pmix", 2, 3, 2, 3, 0, 1, None, None)),
    "srun-pmi2": (SLURM_PMI2, ("mpich", 1, 3, 1, 3, 0, 1, None, None)),
    "openmpi-in-allocation": (
        OPENMPI_IN_ALLOCATION,
        ("openmpi", 2, 4, 0, 2, None, None, None, None),
    ),
    "torchrun-in-srun": (TORCHRUN_IN_SRUN, ("torchrun", 3, 4, 1, 2, 1, 2, "10.0.0.1", 29500)),
    "launch-under-openmpi": (
        LAUNCH_UNDER_OPENMPI,
        ("torchrun", 1, 2, 1, 2, 0, 1, "127.0.0.1", 41234),
    ),
    "single-process": (
        {"PATH": "/usr/bin", "HOME": "/root"},
        ("single", 0, 1, 0, 1, 0, 1, "127.0.0.1", None),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_captured_environment_is_described_exactly(name: str) -> None:
    env, expected = CASES[name]
    info = detect(env, hostname=HOST)
    assert tuple(getattr(info, f) for f in F) == expected
    assert info.node_id == HOST
    assert set(info.source) <= set(env) | {"WORLD_SIZE/LOCAL_WORLD_SIZE", "SLURM_JOB_ID"}


def test_slurm_port_is_derived_from_job_and_step_identically_on_every_rank() -> None:
    ports = {
        detect({**SLURM_THREE_NODES, "SLURM_PROCID": str(r)}, hostname=HOST).master_port
        for r in range(3)
    }
    assert len(ports) == 1
    (port,) = ports
    assert port is not None and port < 32768
    next_step = detect({**SLURM_THREE_NODES, "SLURM_STEP_ID": "3"}, hostname=HOST)
    assert next_step.master_port != port


@pytest.mark.parametrize("step", ["0", "1", "7", "batch"])
def test_slurm_ports_and_the_store_above_them_stay_below_the_ephemeral_range(step: str) -> None:
    # Linux hands out 32768-60999 to outgoing connections: a port there may be taken by
    # any connection on rank 0's node, and distcache's store listens one above it.
    from launch._detect import SLURM_PORT_HIGH, SLURM_PORT_LOW
    from launch._rendezvous import EPHEMERAL_LOW, PORT_OFFSET

    jobs = [str(j) for j in range(1, 20_001)] + [f"{j}_{t}" for j in (5, 987654) for t in range(50)]
    detected = [detect({**SLURM_THREE_NODES, "SLURM_JOB_ID": job, "SLURM_STEP_ID": step},
                       hostname=HOST).master_port for job in jobs[::97]]
    assert None not in detected
    ports = [p for p in detected if p is not None]
    assert ports == [launch._detect.slurm_port(job, step) for job in jobs[::97]]
    ports += [launch._detect.slurm_port(job, step) for job in jobs]
    assert min(ports) >= 10000
    assert max(p + PORT_OFFSET for p in ports) < EPHEMERAL_LOW == 32768
    assert (SLURM_PORT_LOW, SLURM_PORT_HIGH + PORT_OFFSET) == (10000, 32767)
    # Spread over the range, so that concurrent jobs on one node rarely meet.
    assert len(set(ports)) > 10_000
    assert min(ports) < 10_100 and max(ports) > 32_600


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN, ("torchrun:none", 0)),
        ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "2"},
         ("torchrun:job-a", 2)),
        (OPENMPI5, ("pmix:prterun-vm-4872@1", 0)),
        ({**OPENMPI_TWO_HOSTS, "OMPI_MCA_ess_base_jobid": "3141"}, ("openmpi:3141", 0)),
        (SLURM_THREE_NODES, ("slurm:48213.2", 0)),
        ({**SLURM_THREE_NODES, "SLURM_STEP_ID": "4", "SLURM_RESTART_COUNT": "1"},
         ("slurm:48213.4", 1)),
        # Under torchrun, the outer launcher's variables describe the agent.
        (TORCHRUN_IN_SRUN, ("torchrun:none", 0)),
        (MPICH_HYDRA, ("", 0)),
        ({}, ("", 0)),
    ],
)
def test_the_run_id_names_the_innermost_launchers_job_and_attempt(
    env: dict[str, str], expected: tuple[str, int]
) -> None:
    job, attempt, used = launch.run_id(env)
    assert (job, attempt) == expected
    assert set(used) <= set(env)


def test_a_malformed_restart_count_is_a_launch_error() -> None:
    with pytest.raises(LaunchError, match="TORCHELASTIC_RESTART_COUNT"):
        launch.run_id({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "two"})


def test_explicit_master_variables_win_over_slurm_derivation() -> None:
    env = {**SLURM_THREE_NODES, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "31000"}
    info = detect(env, hostname=HOST)
    assert (info.master_addr, info.master_port) == ("10.1.2.3", 31000)


@pytest.mark.parametrize("addr", ["  ", "127.0.0.1 # c", "host\n", "h\u00f6st", "a" * 254])
def test_a_master_addr_that_is_no_host_is_a_launch_error(addr: str) -> None:
    # It was looked up as a host name, after the whole rendezvous timeout, and the
    # failure then blamed MASTER_PORT.
    with pytest.raises(LaunchError, match="is not a host name or address") as err:
        detect({**TORCHRUN, "MASTER_ADDR": addr}, hostname=HOST)
    assert err.value.variable == "MASTER_ADDR"  # type: ignore[attr-defined]


@pytest.mark.parametrize("addr", ["node-1.cluster", "10.0.0.1", "fe80::1", "[fe80::1%eth0]"])
def test_host_names_and_addresses_are_taken_as_master_addr(addr: str) -> None:
    assert detect({**TORCHRUN, "MASTER_ADDR": addr}, hostname=HOST).master_addr == addr


def test_arbitrary_slurm_distribution_leaves_master_addr_unknown() -> None:
    info = detect({**SLURM_THREE_NODES, "SLURM_DISTRIBUTION": "arbitrary"}, hostname=HOST)
    assert info.master_addr is None


def test_node_id_override_replaces_hostname() -> None:
    info = detect({**OPENMPI5, "DISTCACHE_NODE_ID": "fake-node-b"}, hostname=HOST)
    assert info.node_id == "fake-node-b"
    assert "DISTCACHE_NODE_ID" in info.source


def test_an_empty_node_id_override_means_the_host_name() -> None:
    # As distcache's settings read it: a blank variable is an unset one.
    assert detect({"DISTCACHE_NODE_ID": ""}, hostname=HOST).node_id == HOST


def test_lone_local_rank_does_not_make_a_launch() -> None:
    info = detect({"LOCAL_RANK": "3"}, hostname=HOST)
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)


@pytest.mark.parametrize(
    ("env", "variables"),
    [
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "4",
            },
            ["RANK=1", "OMPI_COMM_WORLD_RANK=2"],
        ),
        ({**OPENMPI5, "PMIX_RANK": "0"}, ["OMPI_COMM_WORLD_RANK=1", "PMIX_RANK=0"]),
        (
            {**MPICH_HYDRA, "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"},
            ["OMPI_COMM_WORLD_SIZE=4", "PMI_SIZE=3"],
        ),
        # A stale `export RANK=0 WORLD_SIZE=1` inside a real srun step.
        ({**SLURM_ONE_NODE, "RANK": "0", "WORLD_SIZE": "1"}, ["RANK=0", "SLURM_PROCID=1"]),
        (
            {**LAUNCH_UNDER_OPENMPI, "LOCAL_RANK": "0"},
            ["LOCAL_RANK=0", "OMPI_COMM_WORLD_LOCAL_RANK=1"],
        ),
    ],
    ids=[
        "torchrun-vs-openmpi",
        "openmpi-vs-pmix",
        "mpich-vs-openmpi",
        "stale-rank-in-srun",
        "launch-vs-openmpi-local",
    ],
)
def test_conflicting_launchers_raise_listing_every_variable(
    env: dict[str, str], variables: list[str]
) -> None:
    with pytest.raises(LaunchError) as err:
        detect(env, hostname=HOST)
    for var in variables:
        assert var in str(err.value)
    assert err.value.conflicts


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"RANK": "0"}, "RANK"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({**OPENMPI5, "OMPI_COMM_WORLD_SIZE": "2.0", "PMIX_RANK": "1"}, "OMPI_COMM_WORLD_SIZE"),
        ({"PMIX_RANK": "3"}, "PMIX_RANK"),
        ({**MPICH_HYDRA, "PMI_RANK": " "}, "PMI_RANK"),
        ({**SLURM_THREE_NODES, "SLURM_NODEID": "3"}, "SLURM_STEP_TASKS_PER_NODE"),
        ({**SLURM_THREE_NODES, "SLURM_STEP_TASKS_PER_NODE": "3,2(x"}, "SLURM_STEP_TASKS_PER_NODE"),
        ({**SLURM_THREE_NODES, "SLURM_STEP_NODELIST": "gpu[008-"}, "SLURM_STEP_NODELIST"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_values_raise_naming_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(LaunchError) as err:
        detect(env, hostname=HOST)
    assert err.value.variable == variable
    assert variable in str(err.value)


def test_launch_error_is_a_value_error_and_survives_pickling() -> None:
    with pytest.raises(LaunchError) as err:
        detect({"RANK": "x", "WORLD_SIZE": "2"}, hostname=HOST)
    assert isinstance(err.value, ValueError)
    assert isinstance(err.value, DistcacheError)
    again = pickle.loads(pickle.dumps(err.value))
    assert (str(again), again.variable) == (str(err.value), "RANK")


def test_launch_info_is_frozen_and_slotted() -> None:
    info = detect({}, hostname=HOST)
    assert isinstance(info, LaunchInfo)
    assert not hasattr(info, "__dict__")
    with pytest.raises(AttributeError):
        info.rank = 3  # type: ignore[misc]


def test_is_mpi_is_true_only_for_mpi_launchers() -> None:
    assert detect(OPENMPI5, hostname=HOST).is_mpi
    assert detect(SLURM_PMIX, hostname=HOST).is_mpi
    assert not detect(TORCHRUN, hostname=HOST).is_mpi
    assert not detect(SLURM_ONE_NODE, hostname=HOST).is_mpi


def test_importing_launch_and_detecting_imports_neither_torch_nor_mpi4py() -> None:
    code = (
        "import sys, launch; launch.detect(); launch.expand_nodelist('a[1-2]');"
        "bad = [m for m in ('torch', 'mpi4py') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_public_names_are_exported() -> None:
    assert set(launch.__all__) >= {
        "LaunchError",
        "LaunchInfo",
        "detect",
        "expand_nodelist",
        "gloo_group",
        "init_process_group",
    }
    for name in launch.__all__:
        assert getattr(launch, name) is not None
