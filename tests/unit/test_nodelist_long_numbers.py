"""Slurm's node lists and task counts with absurdly long numbers are a LaunchError
naming the variable, never a raw ValueError from int()."""

from __future__ import annotations

import pytest

from distcache.errors import LaunchError
from launch import detect
from launch._nodelist import expand_counts, expand_nodelist

_HUGE = "1" * 5000


@pytest.mark.parametrize("text", [f"gpu[{_HUGE}]", f"gpu[1-{_HUGE}]", f"gpu[{'0' * 5000}1]",
                                  f"gpu[{'1' * 19}]"])
def test_a_long_range_number_is_a_launch_error(text: str) -> None:
    with pytest.raises(LaunchError, match="at most 18 digits") as caught:
        expand_nodelist(text)
    assert len(str(caught.value)) < 500  # the value is not echoed whole


@pytest.mark.parametrize("text", [f"{_HUGE},1", f"1(x{_HUGE})", f"{'1' * 19}"])
def test_a_long_task_count_is_a_launch_error(text: str) -> None:
    with pytest.raises(LaunchError, match="at most 18 digits"):
        expand_counts(text)


def test_numbers_launchers_write_still_expand() -> None:
    assert expand_nodelist("gpu[0001-0003]") == ["gpu0001", "gpu0002", "gpu0003"]
    assert expand_nodelist(f"n[{'9' * 18}]") == [f"n{'9' * 18}"]
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]


def test_detect_names_the_variable_for_a_long_task_count() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "1" * 4301}
    with pytest.raises(LaunchError) as caught:
        detect(env)
    assert "SLURM_STEP_TASKS_PER_NODE" in str(caught.value) or "task counts" in str(caught.value)
