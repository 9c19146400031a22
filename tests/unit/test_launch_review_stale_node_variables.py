"""torchrun's node variables (``GROUP_RANK``, ``GROUP_WORLD_SIZE``) left in the
environment from another job: the wrapper, which reads them only beside ``RANK``,
ignores them under ``srun`` or ``mpirun``, and PROGRAM, which finds the ``RANK`` the
wrapper exports, must not read them as torchrun's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from launch import detect
from launch.__main__ import child_environment
from tests.support.cli import cli_env

REPO = Path(__file__).resolve().parents[2]
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE")
STALE = {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}


def _step(procid: int, nodeid: int, nodes: int) -> dict[str, str]:
    """Rank ``procid`` of an srun step of two tasks per node on ``nodes`` nodes."""
    return {
        "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
        "SLURM_STEP_NUM_TASKS": str(2 * nodes), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_TASKS_PER_NODE": f"2(x{nodes})", "SLURM_NODEID": str(nodeid),
        "SLURM_LOCALID": str(procid % 2), "SLURM_STEP_NODELIST": f"n[1-{nodes}]",
    }


def test_program_under_srun_sees_the_step_not_a_stale_group_rank() -> None:
    step = {**_step(procid=1, nodeid=0, nodes=2), **STALE}
    wrapper = detect(step, hostname="n1")
    program = detect(child_environment(wrapper, step, {}), hostname="n1")
    assert (program.node_rank, program.num_nodes) == (0, 2)
    assert (program.rank, program.world_size) == (1, 4)


def test_stale_group_variables_are_not_passed_on_where_the_launcher_gives_none() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", **STALE}
    wrapper = detect(env, hostname="h").replace(master_addr="n1", master_port=20000)
    assert wrapper.node_rank is None and wrapper.num_nodes is None
    program_env = child_environment(wrapper, env, {})
    assert "GROUP_RANK" not in program_env and "GROUP_WORLD_SIZE" not in program_env
    program = detect(program_env, hostname="h")
    assert (program.rank, program.world_size, program.local_rank) == (1, 4, 1)


def test_torchruns_own_group_variables_are_passed_on() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "r",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    program_env = child_environment(detect(env, hostname="h"), env, {})
    assert (program_env["GROUP_RANK"], program_env["GROUP_WORLD_SIZE"]) == ("1", "2")


def test_the_wrapper_runs_program_under_srun_with_a_stale_group_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in cli_env(tmp_path).items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env.update(_step(procid=1, nodeid=0, nodes=1), **STALE, PYTHONDONTWRITEBYTECODE="1")
    program = ("import os; from launch import detect; i = detect(); "
               "print(i.node_rank, i.num_nodes, os.environ['GROUP_RANK'])")
    done = subprocess.run([sys.executable, "-m", "launch", "--", sys.executable, "-c", program],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
                          start_new_session=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "0"]
