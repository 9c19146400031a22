"""The wrapper's refusal of a job with no rendezvous names the variable that is missing
(not one the user set), why the launcher gives none, and what to set it to; a
``MASTER_PORT`` out of range says the range of TCP ports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch import LaunchError, detect
from tests.support.cli import cli_env

REPO = Path(__file__).resolve().parents[2]
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE")


def _launch(tmp_path: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in cli_env(tmp_path).items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env.update(variables, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "launch", "--", "true"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120, start_new_session=True,
                          check=False)


def _error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m launch: error: "), done.stderr
    return lines[0]


def test_a_master_addr_that_is_set_is_not_asked_for(tmp_path: Path) -> None:
    line = _error(_launch(tmp_path, RANK="0", WORLD_SIZE="4", MASTER_ADDR="node1"))
    assert "gives no MASTER_PORT;" in line, line
    assert "set MASTER_PORT to a free port on rank 0's host" in line
    assert "MASTER_ADDR" not in line


def test_neither_set_asks_for_both(tmp_path: Path) -> None:
    line = _error(_launch(tmp_path, RANK="0", WORLD_SIZE="4"))
    assert "gives no MASTER_ADDR or MASTER_PORT;" in line, line
    assert "set MASTER_ADDR to rank 0's host name and MASTER_PORT to a free port" in line


@pytest.mark.parametrize("layout", [{"SLURM_DISTRIBUTION": "arbitrary"},
                                    {"SLURM_HOSTFILE": "/etc/hosts.job"}])
def test_an_arbitrary_slurm_layout_says_why_it_gives_no_address(
    tmp_path: Path, layout: dict[str, str],
) -> None:
    step = {"SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "n[1-2]", **layout}
    line = _error(_launch(tmp_path, **step))
    # The port is derived from the job id: only the address is missing.
    assert "slurm launch of 4 ranks gives no MASTER_ADDR (" in line, line
    assert "need not be rank 0's" in line
    assert "set MASTER_ADDR to rank 0's host name, the same on every rank" in line
    assert "MASTER_PORT" not in line


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_a_master_port_out_of_range_names_the_tcp_range(port: str) -> None:
    with pytest.raises(LaunchError) as caught:
        detect({"MASTER_PORT": port}, hostname="h")
    assert f"MASTER_PORT='{port}' must be from 1 to 65535" in str(caught.value)
