"""A producer killed before it unlinked its segment (before the exchange barrier: the
OOM killer, a preempted job) left the name, and its memory, in /dev/shm until reboot.
The next segment made on the host sweeps such names: this user's, unlocked (their
producer is gone) and unchanged for a while; a live producer's, a young one, another
user's and anything not a regular file stay (distcache.ipc._stale)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from distcache.ipc import ShmPool
from distcache.ipc import _stale as stale
from distcache.ipc._shm import SHM_DIR
from distcache.store._fs import unlink_quietly

# A producer that makes its pool, says where it is, then waits to be killed.
_PRODUCER = """
import sys, time
from distcache.ipc import ShmPool
pool = ShmPool(1 << 16, slots=4, name=sys.argv[1])
print(pool.path, flush=True)
time.sleep(120)
"""


@pytest.fixture
def prefix() -> Iterator[str]:
    made = f"stale-{os.getpid()}-{secrets.token_hex(3)}"
    yield made
    for name in os.listdir(SHM_DIR):
        if name.startswith(f"distcache.{made}"):
            unlink_quietly(os.path.join(SHM_DIR, name))


def _producer(name: str) -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen([sys.executable, "-c", _PRODUCER, name], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert child.stdout is not None
    path = child.stdout.readline().strip()
    assert path and os.path.exists(path), "the producer made no segment"
    return child, path


def _end(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.stdout is not None
    child.stdout.close()


def _killed_producer(name: str) -> str:
    child, path = _producer(name)
    _end(child)
    assert os.path.exists(path)  # what a producer killed before the barrier leaves
    return path


def _aged(path: str, seconds: float = 3600) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_a_killed_producers_segment_is_swept_by_the_next_pool(
        prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    left = _killed_producer(f"{prefix}-dead")
    # A file's ctime cannot be set back: the pool's sweep takes any age here.
    monkeypatch.setattr("distcache.ipc._shm.sweep_stale",
                        lambda where: stale.sweep_stale(where, older_than=0.0))
    with ShmPool(1 << 12, slots=4, name=f"{prefix}-new") as made:
        assert not os.path.exists(left)
        assert os.path.exists(made.path)


def test_the_sweep_names_what_it_removed(prefix: str) -> None:
    left = _killed_producer(f"{prefix}-dead")
    assert stale.sweep_stale(SHM_DIR, older_than=0.0) == [os.path.basename(left)]
    assert not os.path.exists(left)
    assert stale.sweep_stale(SHM_DIR, older_than=0.0) == []


def test_a_live_producers_segment_stays(prefix: str) -> None:
    child, path = _producer(f"{prefix}-live")
    try:
        _aged(path)
        assert os.path.basename(path) not in stale.sweep_stale(SHM_DIR, older_than=0.0)
        assert os.path.exists(path)
    finally:
        _end(child)
    # Its lock went with it: now it is stale.
    assert os.path.basename(path) in stale.sweep_stale(SHM_DIR, older_than=0.0)


def test_a_young_unlocked_segment_stays(prefix: str) -> None:
    """A creator opens its segment before it locks it: a name changed within
    STALE_AFTER_S is never taken for a dead producer's."""
    left = _killed_producer(f"{prefix}-young")
    assert os.path.basename(left) not in stale.sweep_stale(SHM_DIR)
    assert os.path.exists(left)


def test_a_pool_closed_normally_leaves_nothing_locked(prefix: str) -> None:
    pool = ShmPool(1 << 12, slots=4, name=f"{prefix}-closed")
    path, fd = pool.path, pool._held
    pool.close()
    assert not os.path.exists(path)
    with pytest.raises(OSError):
        os.fstat(fd)  # the held descriptor went with the name


def test_a_link_or_a_directory_stays(prefix: str, tmp_path: os.PathLike[str]) -> None:
    link = os.path.join(SHM_DIR, f"distcache.{prefix}-link")
    folder = os.path.join(SHM_DIR, f"distcache.{prefix}-dir")
    target = os.path.join(os.fspath(tmp_path), "target")
    open(target, "w").close()
    os.symlink(target, link)
    os.mkdir(folder)
    try:
        _aged(link)
        _aged(folder)
        removed = stale.sweep_stale(SHM_DIR, older_than=0.0)
        assert os.path.basename(link) not in removed and os.path.lexists(link)
        assert os.path.basename(folder) not in removed and os.path.isdir(folder)
    finally:
        unlink_quietly(link)
        os.rmdir(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_another_users_segment_stays(prefix: str) -> None:
    path = os.path.join(SHM_DIR, f"distcache.{prefix}-other")
    with open(path, "wb") as out:
        out.write(b"\0" * 4096)
    os.chown(path, 65534, 65534)
    _aged(path)
    assert os.path.basename(path) not in stale.sweep_stale(SHM_DIR, older_than=0.0)
    assert os.path.exists(path)
