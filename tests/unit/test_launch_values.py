"""Values the launcher variables may not take, refused with the variable named."""

from __future__ import annotations

import pytest

from launch import LaunchError, detect, find_store


@pytest.mark.parametrize("rank", [0, 1])
def test_the_last_port_leaves_no_room_for_the_store_above_it(rank: int) -> None:
    pytest.importorskip("torch.distributed")
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "65535"}
    info = detect(env, hostname="h")
    assert info.master_port == 65535  # a port torch's own env:// rendezvous may use
    with pytest.raises(LaunchError, match="MASTER_PORT=65535") as err:
        find_store(info, 3, env)
    assert err.value.variable == "MASTER_PORT"


_STEP = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "n[1-2]",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"RANK": "1_0", "WORLD_SIZE": "20"}, "RANK"),
        ({"RANK": "\uff11", "WORLD_SIZE": "2"}, "RANK"),  # a full-width digit one
        ({"RANK": "0", "WORLD_SIZE": "\u0662"}, "WORLD_SIZE"),  # an Arabic-Indic two
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "7"}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "2"}, "GROUP_RANK"),
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "0(x2)"}, "SLURM_STEP_TASKS_PER_NODE"),
        ({**_STEP, "SLURM_STEP_TASKS_PER_NODE": "2,0"}, "SLURM_STEP_TASKS_PER_NODE"),
    ],
    ids=["underscore", "full-width", "arabic-indic", "local-rank-past-world",
         "group-rank-past-world", "no-tasks-anywhere", "no-tasks-on-a-node"],
)
def test_odd_values_are_refused_naming_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(LaunchError) as err:
        detect(env, hostname="h")
    assert err.value.variable == variable
    assert variable in str(err.value)


def test_plain_integers_with_surrounding_blanks_are_still_read() -> None:
    info = detect({"RANK": " 1\n", "WORLD_SIZE": "+2", "LOCAL_RANK": "1"}, hostname="h")
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 1)
