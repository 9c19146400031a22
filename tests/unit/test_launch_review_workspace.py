"""``--workspace`` slots that are symbolic links, are not directories, belong to someone
else, or sit on a disk that takes no more bytes."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from launch import WorkspaceError
from launch._workspace import LOCK_NAME, acquire_slot
from tests.support.cli import cli_env

REPO = Path(__file__).resolve().parents[2]
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK")
PRINT_WORKSPACE = "import os; print(os.environ['DISTCACHE_WORKSPACE'])"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in cli_env(tmp_path).items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _launch(tmp_path: Path, workspace: Path,
            file_size_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m launch --workspace WORKSPACE -- python -c PRINT_WORKSPACE``, its output
    on pipes (a file size limit applies to files only), in a session of its own."""

    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        [sys.executable, "-m", "launch", "--workspace", str(workspace), "--",
         sys.executable, "-c", PRINT_WORKSPACE],
        capture_output=True, text=True, env=_env(tmp_path), cwd=REPO, timeout=120,
        start_new_session=True, preexec_fn=limit, check=False)


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_kept(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "notes.txt"
    victim.write_text("a user's own file\n")
    (tmp_path / "ws" / "rank-0").mkdir(parents=True)
    (tmp_path / "ws" / "rank-0" / LOCK_NAME).symlink_to(victim)
    done = _launch(tmp_path, tmp_path / "ws")
    assert victim.read_text() == "a user's own file\n"
    assert done.returncode == 1, done.stderr
    assert "is a symbolic link" in done.stderr and str(victim) in done.stderr, done.stderr
    assert "remove the link" in done.stderr, done.stderr
    assert done.stdout == ""  # PROGRAM never ran


def test_a_slot_that_is_a_symbolic_link_is_refused_and_nothing_written_where_it_points(
    tmp_path: Path,
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "rank-0").symlink_to(elsewhere)
    done = _launch(tmp_path, tmp_path / "ws")
    assert done.returncode == 1, done.stderr
    assert list(elsewhere.iterdir()) == []
    assert f"{tmp_path / 'ws' / 'rank-0'} is a symbolic link (to {elsewhere})" in done.stderr
    assert done.stdout == ""


def test_a_workspace_reached_through_a_symbolic_link_is_used(tmp_path: Path) -> None:
    # A link above the slots (/scratch -> /mnt/nvme) is where the user put the workspace.
    (tmp_path / "disk").mkdir()
    (tmp_path / "ws").symlink_to(tmp_path / "disk")
    done = _launch(tmp_path, tmp_path / "ws")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "ws" / "rank-0")
    assert (tmp_path / "disk" / "rank-0" / LOCK_NAME).is_file()


def test_a_workspace_that_is_a_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "ws").write_text("")
    with pytest.raises(WorkspaceError) as caught:
        acquire_slot(tmp_path / "ws")
    message = str(caught.value)
    assert f"{tmp_path / 'ws'} exists and is not a directory" in message, message
    assert "remove it" in message


def test_another_users_slot_says_whose_it_is_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_open = os.open

    def denied(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if path == LOCK_NAME:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(WorkspaceError) as caught:
        acquire_slot(tmp_path)
    message = str(caught.value)
    owner = os.stat(tmp_path / "rank-0").st_uid
    assert f"owned by uid {owner}" in message, message
    assert f"runs as uid {os.geteuid()}" in message
    assert "give --workspace a directory of this user's own" in message


def test_a_full_disk_does_not_keep_a_warm_slot_from_being_used(tmp_path: Path) -> None:
    # The slot and its lock file are there from an earlier run; the disk now takes no
    # more bytes (a file size limit of 0 fails every write as a full disk does).
    first = _launch(tmp_path, tmp_path / "ws")
    assert first.returncode == 0, first.stderr
    done = _launch(tmp_path, tmp_path / "ws", file_size_limit=0)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "ws" / "rank-0")


def test_a_failed_holder_note_leaves_the_slot_free_again_on_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", full)
        slot = acquire_slot(tmp_path)
    assert slot.index == 0 and slot.held
    slot.release()
    again = acquire_slot(tmp_path)  # the lock went with the release: rank-0 is free
    assert again.index == 0
    again.release()
