"""Half-set launcher environments and a blank ``DISTCACHE_NODE_ID``, as
:func:`launch.detect` reads them."""

from __future__ import annotations

import logging

import pytest

from distcache.config import settings
from distcache.errors import LaunchError
from launch import detect

HOST = "host-a"


@pytest.mark.parametrize(
    ("env", "present", "missing"),
    [
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4", "RANK"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_RANK"),
        ({"PMI_SIZE": "4"}, "PMI_SIZE=4", "PMI_RANK"),
        ({"SLURM_STEP_NUM_TASKS": "4"}, "SLURM_STEP_NUM_TASKS=4", "SLURM_PROCID"),
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS"),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4"}, "SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS"),
    ],
)
def test_a_half_set_launcher_is_not_taken_for_a_single_process(
    env: dict[str, str], present: str, missing: str,
) -> None:
    with pytest.raises(LaunchError) as err:
        detect(env, hostname=HOST)
    message = str(err.value)
    assert present in message and missing in message, message
    assert err.value.variable == present.split("=")[0]


@pytest.mark.parametrize(
    ("env", "present", "missing"),
    [
        ({"RANK": "1"}, "RANK", "WORLD_SIZE"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ],
)
def test_a_rank_without_a_size_is_refused_naming_both(
    env: dict[str, str], present: str, missing: str,
) -> None:
    with pytest.raises(LaunchError) as err:
        detect(env, hostname=HOST)
    assert present in str(err.value) and missing in str(err.value), str(err.value)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "1"}, {"PMI_SIZE": "1"},
                                 {"SLURM_STEP_NUM_TASKS": "1"}])
def test_a_world_of_one_without_a_rank_is_one_process(env: dict[str, str]) -> None:
    info = detect(env, hostname=HOST)
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)


def test_a_batch_script_is_one_process_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # sbatch's script: job-level variables and SLURM_PROCID=0, but no srun step.
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    with caplog.at_level(logging.INFO):
        info = detect(env, hostname=HOST)
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)
    assert any("SLURM_STEP_NUM_TASKS" in r.getMessage() and "srun" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("blank", ["", " ", "\t\n"])
def test_a_blank_node_id_is_unset_for_launch_as_for_init(blank: str) -> None:
    env = {"DISTCACHE_NODE_ID": blank}
    assert settings(env).node_id is None  # distcache's own reading: unset
    info = detect(env, hostname=HOST)
    assert info.node_id == HOST  # the host name, as distcache's communicators use
    assert "DISTCACHE_NODE_ID" not in info.source


def test_a_named_node_id_is_read_alike() -> None:
    env = {"DISTCACHE_NODE_ID": "node-7"}
    assert detect(env, hostname=HOST).node_id == settings(env).node_id == "node-7"
