"""Per-rank workspace slots guarded by kernel locks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import launch
from distcache import errors
from launch import WorkspaceError
from launch._workspace import LOCK_NAME, acquire_slot

HOLDER = textwrap.dedent(
    """
    import sys, time
    from launch._workspace import acquire_slot
    slot = acquire_slot(sys.argv[1], start=int(sys.argv[2]))
    print(slot.index, flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A separate process holding slot rank-0, killed (hard) at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "0"
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def test_free_slot_is_taken_at_the_start_index(tmp_path: Path) -> None:
    with acquire_slot(tmp_path, start=3) as slot:
        assert slot.index == 3
        assert slot.path == tmp_path / "rank-3"
        assert (slot.path / LOCK_NAME).is_file()


def test_busy_slot_moves_on_to_the_next_free_index(tmp_path: Path) -> None:
    with acquire_slot(tmp_path, 0) as first, acquire_slot(tmp_path, 0) as second:
        assert (first.index, second.index) == (0, 1)
        with acquire_slot(tmp_path, 1) as third:
            assert third.index == 2


def test_released_slot_is_reused_and_keeps_its_contents(tmp_path: Path) -> None:
    slot = acquire_slot(tmp_path, 0)
    (slot.path / "kernel.bin").write_bytes(b"cached")
    slot.release()
    slot.release()  # idempotent
    assert not slot.held
    with acquire_slot(tmp_path, 0) as again:
        assert again.index == 0
        assert (again.path / "kernel.bin").read_bytes() == b"cached"


def test_slot_held_by_another_process_is_skipped(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    with acquire_slot(tmp_path, 0) as slot:
        assert slot.index == 1
    assert f" {holder.pid}" in (tmp_path / "rank-0" / LOCK_NAME).read_text()


def test_lock_is_released_when_its_holder_is_killed(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    with acquire_slot(tmp_path, 0) as slot:
        assert slot.index == 0


def test_workspace_error_is_the_error_tree_s_and_launch_exports_it() -> None:
    assert launch.WorkspaceError is errors.WorkspaceError
    assert "WorkspaceError" in launch.__all__


def test_unusable_root_raises_workspace_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(WorkspaceError) as err:
        acquire_slot(blocker, 0)
    assert isinstance(err.value, OSError)
    assert "rank-0" in err.value.path


def test_negative_start_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        acquire_slot(tmp_path, -1)
