"""What ``doctor`` says of a pool whose ``format`` file is empty or not a file, of a
pool path where no pool can be made, and of the filesystem a pool is on: it looks
only, answers at once, and names a filesystem for what it is."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from distcache import cli
from distcache.cli import _doctor
from distcache.store import ArtifactPool
from tests.support.cli import cli_env, run_read_only
from tests.support.helpers import clear_settings


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


def _pool_line(capsys: pytest.CaptureFixture[str], pool: Path) -> str:
    capsys.readouterr()
    assert cli.main(["--pool", str(pool), "doctor"]) == 0
    out, err = capsys.readouterr()
    assert not err, err
    return next(x for x in out.splitlines() if x.startswith("pool:"))


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_doctor_leaves_an_abandoned_empty_format_file_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "pool"
    ArtifactPool(root)
    fmt = root / "format"
    fmt.chmod(0o644)
    fmt.write_text("")
    hours_ago = time.time() - 2 * 3600
    os.utime(fmt, (hours_ago, hours_ago))
    for path in (root / "locks").iterdir():
        path.unlink()
    (root / "locks").rmdir()
    before = _tree(root)
    line = _pool_line(capsys, root)
    assert _tree(root) == before, line  # no format file removed, no locks/ made
    assert f"{root} (" in line, line


def test_doctor_does_not_wait_on_a_fifo_for_a_format_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "pool"
    ArtifactPool(root)
    fmt = root / "format"
    fmt.unlink()
    os.mkfifo(fmt)
    started = time.monotonic()
    line = _pool_line(capsys, root)
    assert time.monotonic() - started < 2.0, line
    assert "NOT USABLE" in line and "not a regular file" in line, line


@pytest.mark.parametrize("exists", [False, True], ids=["absent", "empty-dir"])
def test_doctor_says_a_pool_on_a_read_only_mount_cannot_be_created(
        tmp_path: Path, exists: bool) -> None:
    mount = tmp_path / "ro"
    mount.mkdir()
    pool = mount / "pool"
    if exists:
        pool.mkdir()
    done = run_read_only(cli_env(tmp_path), mount, [sys.executable, "-m", "distcache",
                                                    "--pool", str(pool), "doctor"])
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("pool:"))
    assert "not created yet" in line and "cannot be created" in line, line


def test_doctor_still_says_a_missing_pool_can_be_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _pool_line(capsys, tmp_path / "pool")
    assert line.endswith(f"{tmp_path / 'pool'} (not created yet)"), line


@pytest.mark.parametrize(("fstype", "note"), [
    ("ext4", None),
    ("fuseblk", None),  # ntfs-3g, exfat: a local disk
    ("nfsd", None),  # the NFS server's control filesystem
    ("nfs4", "a network filesystem"),
    ("lustre", "a network filesystem"),
    ("fuse.sshfs", "FUSE"),
    ("fuse", "FUSE"),
])
def test_doctor_calls_only_network_filesystems_network_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fstype: str,
        note: str | None) -> None:
    monkeypatch.setattr(_doctor, "filesystem_of", lambda path: (fstype, "/mnt", "dev"))
    line = dict(_doctor.doctor_lines(tmp_path / "pool"))["filesystem"]
    assert line.startswith(f"{fstype} on /mnt (dev)"), line
    if note is None:
        assert "network" not in line and "FUSE" not in line, line
    else:
        assert note in line and "locks may not exclude" in line, line
