"""FileLock: kernel-released, bounded-wait, degrading to no lock where locks fail."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distcache.store import _locking as locking
from distcache.store._locking import FileLock, flock_fd

REPO = Path(__file__).resolve().parents[2]

HOLDER = """
import sys, time
from distcache.store._locking import FileLock
lock = FileLock(sys.argv[1], timeout=5)
assert lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def _start_holder(path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "held":
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"lock holder did not start: {line!r}")
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def test_acquire_and_release_then_reacquire(tmp_path: Path) -> None:
    lock = FileLock(tmp_path / "a.lock", timeout=1)
    assert lock.acquire()
    assert lock.held and not lock.degraded
    lock.release()
    lock.release()  # idempotent
    assert not lock.held
    assert lock.acquire()
    lock.release()


def test_second_lock_in_same_process_times_out_while_first_is_held(tmp_path: Path) -> None:
    first = FileLock(tmp_path / "a.lock", timeout=1)
    second = FileLock(tmp_path / "a.lock", timeout=0.05)
    assert first.acquire()
    try:
        assert second.acquire() is False
        assert not second.held
    finally:
        first.release()
    assert second.acquire()
    second.release()


def test_zero_timeout_tries_once(tmp_path: Path) -> None:
    first = FileLock(tmp_path / "a.lock", timeout=1)
    assert first.acquire()
    try:
        assert FileLock(tmp_path / "a.lock", timeout=0).acquire() is False
    finally:
        first.release()


def test_threads_exclude_each_other(tmp_path: Path) -> None:
    inside = 0
    overlaps = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, overlaps
        for _ in range(20):
            lock = FileLock(tmp_path / "t.lock", timeout=30)
            assert lock.acquire()
            with guard:
                inside += 1
                overlaps += inside > 1
            time.sleep(0.0005)
            with guard:
                inside -= 1
            lock.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert overlaps == 0


def test_lock_held_by_another_process_blocks_until_timeout(tmp_path: Path) -> None:
    path = tmp_path / "p.lock"
    proc = _start_holder(path)
    try:
        assert FileLock(path, timeout=0.1).acquire() is False
    finally:
        _kill(proc)


@pytest.mark.timeout(60)
def test_dead_holder_releases_lock_via_kernel(tmp_path: Path) -> None:
    path = tmp_path / "p.lock"
    proc = _start_holder(path)
    _kill(proc)  # kill -9: no cleanup code runs in the holder
    assert path.exists()  # the file stays; the lock does not
    lock = FileLock(path, timeout=0)
    assert lock.acquire() is True
    assert lock.held
    lock.release()


def test_remove_on_release_deletes_file_and_waiter_relocks_new_file(tmp_path: Path) -> None:
    path = tmp_path / "r.lock"
    holder = FileLock(path, timeout=1, remove_on_release=True)
    assert holder.acquire()
    # A waiter opened the same inode while it was held.
    waiter = FileLock(path, timeout=5)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(waiter.acquire()))
    thread.start()
    time.sleep(0.05)
    holder.release()
    thread.join(timeout=30)
    assert result == [True]
    assert not os.path.exists(path) or os.stat(path).st_ino == os.fstat(waiter._fd or -1).st_ino
    # The waiter holds the lock on the file the path now names, so a third party
    # is excluded rather than locking an orphaned inode.
    assert FileLock(path, timeout=0).acquire() is False
    waiter.release()


def test_symlink_at_lock_path_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "outside" / "victim"
    victim.parent.mkdir()
    path = tmp_path / "s.lock"
    os.symlink(victim, path)
    lock = FileLock(path, timeout=1)
    assert lock.acquire()
    lock.release()
    assert not victim.exists()
    assert not path.is_symlink()


def test_unsupported_locks_degrade_to_no_lock_and_warn_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(locking, "_warned_dirs", set())
    caplog.set_level(logging.WARNING, logger="distcache.store._locking")
    first = FileLock(tmp_path / "a.lock", timeout=1)
    second = FileLock(tmp_path / "b.lock", timeout=1)
    assert first.acquire() and second.acquire()
    assert first.degraded and second.degraded
    assert not first.held
    first.release()
    second.release()
    warnings = [r for r in caplog.records if "file locks unavailable" in r.getMessage()]
    assert len(warnings) == 1


def test_unwritable_lock_directory_degrades(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def read_only(path: str, flags: int, mode: int = 0o777) -> int:
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", read_only)
    lock = FileLock(tmp_path / "ro.lock", timeout=1)
    assert lock.acquire()
    assert lock.degraded


def test_flock_fd_reports_timeout(tmp_path: Path) -> None:
    path = tmp_path / "f.lock"
    holder = FileLock(path, timeout=1)
    assert holder.acquire()
    fd = os.open(path, os.O_RDWR)
    try:
        assert flock_fd(fd, 0.02, path=str(path)) is False
    finally:
        os.close(fd)
        holder.release()


def test_negative_timeout_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        FileLock(tmp_path / "x.lock", timeout=-1)
