"""Numbers read from launchers' variables and the pool's own file names are ASCII
digits: ``str.isdigit`` also takes "²" (which ``int`` refuses) and other scripts'
digits (which no launcher writes), so each such text is refused, or read as absent,
never a ValueError or a number it does not say."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distcache.errors import LaunchError
from tests.support.helpers import run_group

SUPERSCRIPT_TWO, ARABIC_THREE = "\u00b2", "\u0663"


@pytest.mark.parametrize("text", [f"gpu[{SUPERSCRIPT_TWO}-3]", f"n[1-{ARABIC_THREE}]"])
def test_a_node_list_with_other_digits_is_refused(text: str) -> None:
    from launch._nodelist import expand_nodelist

    with pytest.raises(LaunchError, match="range item"):
        expand_nodelist(text)


@pytest.mark.parametrize("text", [SUPERSCRIPT_TWO, f"2(x{ARABIC_THREE})", ARABIC_THREE])
def test_task_counts_with_other_digits_are_refused(text: str) -> None:
    from launch._nodelist import expand_counts

    with pytest.raises(LaunchError, match="task counts"):
        expand_counts(text)


def test_launch_names_a_bad_slurm_variable_instead_of_a_traceback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI", "DISTCACHE_"))}
    env.update(SLURM_JOB_ID="5", SLURM_STEP_ID="0", SLURM_PROCID="0",
               SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="0",
               SLURM_STEP_TASKS_PER_NODE=SUPERSCRIPT_TWO,
               DISTCACHE_POOL=str(tmp_path / "pool"))
    done = run_group([sys.executable, "-m", "launch", "--", "true"], timeout=120, env=env)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "SLURM_STEP_TASKS_PER_NODE" in done.stderr


def test_a_quarantine_entry_with_other_digits_is_not_one_of_ours() -> None:
    from distcache.store.layout import PoolLayout

    sha = "a" * 64
    assert PoolLayout.quarantined_at(f"{sha}.{SUPERSCRIPT_TWO}.1.x") is None
    assert PoolLayout.quarantined_at(f"{sha}.12.1.x") == 12


def test_a_local_process_count_with_other_digits_reads_as_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from distcache.comm import _base

    for name in _base._LOCAL_PROCESSES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", SUPERSCRIPT_TWO)
    _base._processes_per_core.cache_clear()  # read once per process: read it again
    try:
        assert _base._longest_pause() == _base._POLL_LONG_S
        assert _base._shortest_pause() == _base._POLL_MIN_S
    finally:
        _base._processes_per_core.cache_clear()


def test_an_owner_variable_with_other_digits_names_no_owner() -> None:
    import socket

    from distcache.integrations._compile_caches import OWNER_VARIABLE, inherited_owner

    value = f"{socket.gethostname()} {SUPERSCRIPT_TWO} 0 d1"
    assert inherited_owner("d1", {OWNER_VARIABLE: value}) is None


@pytest.mark.parametrize("variable", ["RANK", "MASTER_PORT", "WORLD_SIZE"])
def test_a_launcher_integer_of_thousands_of_digits_is_a_launch_error(variable: str) -> None:
    """Past 4,300 digits int() raises its own ValueError; no launcher writes such a
    figure, and the error names the variable."""
    from launch._sources import read_int

    with pytest.raises(LaunchError, match=variable):
        read_int({variable: "9" * 5000}, variable)
    with pytest.raises(LaunchError, match="must be from"):
        read_int({variable: "1" + "0" * 19}, variable)
    assert read_int({variable: " 12 "}, variable) == 12


def test_a_restart_count_the_run_scope_cannot_carry_is_refused_by_name() -> None:
    """The run scope's answer carries the attempt in at most 9 digits: a larger count
    would be refused by every other rank as something other than distcache's."""
    from launch import run_id

    env = {"TORCHELASTIC_RUN_ID": "job1", "TORCHELASTIC_RESTART_COUNT": "1234567890"}
    with pytest.raises(LaunchError, match="TORCHELASTIC_RESTART_COUNT"):
        run_id(env)
    assert run_id({**env, "TORCHELASTIC_RESTART_COUNT": "999999999"})[1] == 999_999_999
