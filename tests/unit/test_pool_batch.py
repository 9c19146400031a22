"""Durability per batch: one flush for a batch of publications, and a torn object
(what a power loss inside a batch can leave) is quarantined and fetched again."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.collective import prefetch
from distcache.comm import LocalCommunicator
from distcache.errors import PoolError
from distcache.origins import DirOrigin
from distcache.store import _durability, _fs
from distcache.store._pool import ArtifactPool


def _blobs(n: int) -> list[bytes]:
    return [f"kernel {i} ".encode() * (50 + i) for i in range(n)]


def _mirror(tmp_path: Path, blobs: list[bytes]) -> list[Artifact]:
    mirror = tmp_path / "mirror"
    arts = []
    for i, data in enumerate(blobs):
        path = mirror / f"k/{i}.cubin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        arts.append(Artifact(f"k/{i}.cubin", hashlib.sha256(data).hexdigest(), len(data)))
    return arts


def _count(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], list[str]]:
    """Count fsyncs and syncfs calls, and record the path of each fsynced descriptor."""
    calls = {"fsync": 0, "syncfs": 0}
    synced: list[str] = []
    real_fsync, real_sync = os.fsync, _fs.sync_filesystem

    def fsync(fd: int) -> None:
        calls["fsync"] += 1
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def sync(path: str | os.PathLike[str]) -> bool:
        calls["syncfs"] += 1
        return real_sync(path)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(_durability, "sync_filesystem", sync)
    return calls, synced


def test_a_batch_flushes_once_instead_of_per_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    calls, _ = _count(monkeypatch)
    with pool.batch():
        shas = [pool.put(data) for data in _blobs(20)]
        # Nothing inside: not the objects, nor objects/ for the 20 new fan-out
        # directories (the batch's flush covers their entries).
        assert len({s[:2] for s in shas}) == 20
        assert calls == {"fsync": 0, "syncfs": 0}
    assert calls["syncfs"] == 1
    # Without syncfs: each file, each fan-out directory, then objects/ once.
    assert calls["fsync"] == (0 if _fs._syncfs() is not None else 20 + 20 + 1)


def test_outside_a_batch_each_object_is_fsynced_with_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    calls, synced = _count(monkeypatch)
    sha = pool.put(b"one object")
    # The file, then objects/ (its fan-out directory is new), then that directory.
    objects, fanout = (os.path.realpath(p) for p in (pool.layout.objects, pool.layout.fanout(sha)))
    assert calls == {"fsync": 3, "syncfs": 0}
    assert os.path.dirname(synced[0]) == os.path.realpath(pool.layout.root / "tmp")
    assert synced[1:] == [objects, fanout]
    # Another object in the same fan-out directory: the file, the directory, then
    # objects/ (the directory may be another process's, made in an unflushed batch).
    data = next(d for i in range(10_000) if hashlib.sha256(
        d := f"another object {i}".encode()).hexdigest()[:2] == sha[:2])
    calls["fsync"] = 0
    synced.clear()
    pool.put(data)
    assert calls == {"fsync": 3, "syncfs": 0}
    assert os.path.dirname(synced[0]) == os.path.realpath(pool.layout.root / "tmp")
    assert synced[1:] == [fanout, objects]


def test_without_syncfs_a_batch_fsyncs_each_file_then_each_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    monkeypatch.setattr(_durability, "sync_filesystem", lambda path: False)
    synced: list[str] = []
    monkeypatch.setattr(_durability, "fsync_path", lambda path: synced.append(str(path)))
    dirs: list[str] = []
    monkeypatch.setattr(_durability, "fsync_dir", lambda path: dirs.append(str(path)))
    with pool.batch():
        shas = [pool.put(data) for data in _blobs(5)]
    assert sorted(synced) == sorted(pool.layout.object_path(s) for s in shas)
    # Each fan-out directory, then objects/, which holds their entries.
    assert dirs == [*sorted({pool.layout.fanout(s) for s in shas}), str(pool.layout.objects)]


def test_a_torn_object_from_a_batch_is_quarantined_and_fetched_again(tmp_path: Path) -> None:
    blobs = _blobs(8)
    arts = _mirror(tmp_path, blobs)
    pool = ArtifactPool(tmp_path / "pool")
    origin = DirOrigin(tmp_path / "mirror")
    first = prefetch(arts, comm=LocalCommunicator(), pool=pool, origin=origin)
    assert first.downloads == 8
    # What a power loss before the batch's flush can leave: linked, bytes torn.
    torn = pool.layout.object_path(arts[3].sha256)
    os.chmod(torn, 0o644)
    with open(torn, "r+b") as f:
        f.truncate(len(blobs[3]) // 2)
    reopened = ArtifactPool(tmp_path / "pool")
    assert reopened.get(arts[3].sha256) is None
    assert reopened.quarantined == 1
    again = prefetch(arts, comm=LocalCommunicator(), pool=reopened, origin=origin)
    assert again.downloads == 1
    assert reopened.get(arts[3].sha256) == blobs[3]


def test_trusting_its_own_objects_skips_hashing_only_for_what_this_pool_published(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"published here")
    assert pool.get(sha, trust_own=True) == b"published here"
    other = ArtifactPool(tmp_path / "pool")
    path = other.layout.object_path(sha)
    os.chmod(path, 0o644)
    Path(path).write_bytes(b"published herE")
    # Another pool object never trusts it: verified, quarantined.
    assert other.get(sha, trust_own=True) is None
    assert other.quarantined == 1


def test_a_long_batch_starts_writing_back_in_the_background_and_still_flushes_at_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    blobs = _blobs(12)
    monkeypatch.setattr(_durability.Durability, "writeback_bytes", len(blobs[0]) * 3)
    synced: list[str] = []

    def sync(path: str | os.PathLike[str]) -> bool:
        synced.append(str(path))
        return True

    monkeypatch.setattr(_durability, "sync_filesystem", sync)
    with pool.batch():
        for data in blobs:
            pool.put(data)
    # A background flush started once 3 blobs were published (more may have, one at
    # a time, depending on timing); the batch joined them, then flushed once more.
    assert 2 <= len(synced) <= 1 + 4
    assert set(synced) == {str(pool.layout.objects)}


def test_a_failed_background_flush_fails_the_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    monkeypatch.setattr(_durability.Durability, "writeback_bytes", 1)
    calls: list[int] = []

    def sync(path: str | os.PathLike[str]) -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "Input/output error", str(path))
        return True

    monkeypatch.setattr(_durability, "sync_filesystem", sync)
    with pytest.raises(PoolError, match="cannot flush"), pool.batch():
        pool.put(b"one object")
    # The next batch starts clean: the error was reported once.
    with pool.batch():
        pool.put(b"another object")


def _hold_flushes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make every ``syncfs`` wait until the second event is set; the first is set
    when one started."""
    started, release = threading.Event(), threading.Event()

    def slow_sync(path: str | os.PathLike[str]) -> bool:
        started.set()
        assert release.wait(30)
        return True

    monkeypatch.setattr(_durability, "sync_filesystem", slow_sync)
    return started, release


def test_a_prefetch_flushes_its_downloads_once_without_waiting_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arts = _mirror(tmp_path, _blobs(10))
    pool = ArtifactPool(tmp_path / "pool")
    started, release = _hold_flushes(monkeypatch)
    report = prefetch(arts, comm=LocalCommunicator(), pool=pool,
                      origin=DirOrigin(tmp_path / "mirror"))
    # It returned while its one flush was still running, every object readable.
    assert report.downloads == 10
    assert started.wait(30)
    assert all(pool.get(a.sha256) is not None for a in arts)
    flushers = [t for t in threading.enumerate() if t.name == "distcache-flush"]
    assert len(flushers) == 1 and not flushers[0].daemon
    release.set()
    flushers[0].join(30)
    assert not flushers[0].is_alive()


def test_a_batch_that_does_not_wait_logs_a_failed_flush(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")

    def failing(path: str | os.PathLike[str]) -> bool:
        raise OSError(5, "Input/output error", str(path))

    monkeypatch.setattr(_durability, "sync_filesystem", failing)
    with pool.batch(wait=False):
        sha = pool.put(b"kept and readable")
    for thread in threading.enumerate():
        if thread.name == "distcache-flush":
            thread.join(30)
    assert pool.get(sha) == b"kept and readable"
    assert any("cannot flush" in r.getMessage() and r.levelname == "ERROR"
               for r in caplog.records)


def test_a_flush_in_the_background_of_a_pool_removed_meanwhile_is_not_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    monkeypatch.setattr(_durability.Durability, "flush_delay", 0.3)
    caplog.set_level(logging.DEBUG, logger="distcache")
    for syncfs in (True, False):  # one syncfs, or an fsync per file and directory
        if not syncfs:
            monkeypatch.setattr(_durability, "sync_filesystem", lambda path: False)
        root = tmp_path / f"pool-{syncfs}"
        pool = ArtifactPool(root)
        with pool.batch(wait=False):
            pool.put(b"published, then the pool is removed")
        shutil.rmtree(root)  # a job's scratch pool, gone before its flush ran
        for thread in _threads("distcache-flush"):
            thread.join(30)
        assert not any(r.levelno >= logging.WARNING for r in caplog.records), [
            r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        # One syncfs of a directory that is gone: said at DEBUG. File by file, what is
        # gone is skipped as a file collected meanwhile is.
        assert any("is gone: nothing to flush" in r.getMessage()
                   for r in caplog.records) == syncfs
        caplog.clear()


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_a_failed_writeback_fails_its_own_batch_not_a_flush_in_the_background(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    monkeypatch.setattr(_durability.Durability, "writeback_bytes", 1)
    calls: list[int] = []
    release, failed = threading.Event(), threading.Event()

    def sync(path: str | os.PathLike[str]) -> bool:
        calls.append(1)
        if len(calls) == 1:  # batch A's writeback: held until B's has failed
            assert release.wait(30)
        elif len(calls) == 2:  # batch B's writeback
            failed.set()
            raise OSError(5, "Input/output error", str(path))
        return True

    monkeypatch.setattr(_durability, "sync_filesystem", sync)
    with pool.batch(wait=False):  # A: its flush goes to the background flusher
        pool.put(b"published by A")
    [flusher] = _threads("distcache-flush")
    with pytest.raises(PoolError, match="cannot flush"), pool.batch():  # B
        pool.put(b"published by B")
        assert failed.wait(30)
        for writeback in _threads("distcache-writeback"):
            if writeback.is_alive() and len(calls) >= 2:
                writeback.join(0.5)  # B's, which failed; A's is still held
        # A's flush finishes now, after B's writeback failed but before B ends.
        release.set()
        flusher.join(30)
        assert not flusher.is_alive()
    # B's failure was B's to raise; A's flush had none and logged none.
    assert not any(r.levelname == "ERROR" for r in caplog.records)


def test_overlapping_batches_wait_for_their_flush_when_one_asked_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    flushed_by: list[str] = []

    def sync(path: str | os.PathLike[str]) -> bool:
        flushed_by.append(threading.current_thread().name)
        return True

    monkeypatch.setattr(_durability, "sync_filesystem", sync)
    opened, close = threading.Event(), threading.Event()

    def waiting_batch() -> None:  # another thread's batch that asks to wait
        with pool.batch():
            opened.set()
            assert close.wait(30)

    other = threading.Thread(target=waiting_batch, name="other")
    with pool.batch(wait=False):
        other.start()
        assert opened.wait(30)
        sha = pool.put(b"kept durable before the last batch returns")
        close.set()
        other.join(30)
    # The batch that did not ask to wait ended last, so it flushed for both, here.
    assert flushed_by == [threading.current_thread().name]
    assert not [t for t in _threads("distcache-flush") if t.is_alive()]
    assert pool.get(sha) == b"kept durable before the last batch returns"


def test_a_batch_nested_in_one_that_does_not_wait_does_not_wait_either(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    started, release = _hold_flushes(monkeypatch)
    with pool.batch(wait=False), pool.batch():  # what a prefetch's steps open inside it
        pool.put(b"flushed in the background")
    assert started.wait(30)
    [flusher] = _threads("distcache-flush")
    release.set()
    flusher.join(30)
    assert not flusher.is_alive()


def test_a_child_forked_during_a_background_flush_flushes_its_own_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    release = threading.Event()
    parent = os.getpid()

    def sync(path: str | os.PathLike[str]) -> bool:
        if os.getpid() == parent:
            assert release.wait(30)  # the parent's flush is still running at the fork
        return True

    monkeypatch.setattr(_durability, "sync_filesystem", sync)
    with pool.batch(wait=False):
        pool.put(b"the parent's object")
    [flusher] = _threads("distcache-flush")
    pid = os.fork()
    if pid == 0:  # the child: no flusher of its parent's, so its own batch starts one
        code = 1
        try:
            with pool.batch(wait=False):
                pool.put(b"the child's object")
            mine = _threads("distcache-flush")
            if len(mine) == 1:
                mine[0].join(30)
                code = 0 if not mine[0].is_alive() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    done, status = os.waitpid(pid, os.WNOHANG)
    while done == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        done, status = os.waitpid(pid, os.WNOHANG)
    if done == 0:  # the child is stuck on state it inherited: fail, do not hang
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    release.set()
    flusher.join(30)
    assert done != 0, "the forked child did not finish its batch within 30 s"
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_background_flush_holds_off_then_flushes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_durability.Durability, "flush_delay", 0.5)
    flushed: list[float] = []

    def sync(path: str | os.PathLike[str]) -> bool:
        flushed.append(time.monotonic())
        return True

    monkeypatch.setattr(_durability, "sync_filesystem", sync)
    pool = ArtifactPool(tmp_path / "pool")
    with pool.batch(wait=False):
        pool.put(b"published, flushed later")
        ending = time.monotonic()  # the hold-off starts after this
    [flusher] = _threads("distcache-flush")
    flusher.join(30)
    assert len(flushed) == 1 and flushed[0] - ending >= 0.5


def test_a_process_that_exits_during_the_hold_off_flushes_at_once(tmp_path: Path) -> None:
    # The hold-off is an hour; the process still exits at once, and flushes first.
    marker = tmp_path / "flushed"
    program = f"""
from distcache.store import _durability
from distcache.store._pool import ArtifactPool
_durability.Durability.flush_delay = 3600.0
real = _durability.sync_filesystem
def marking(path):
    open({str(marker)!r}, "w").write("yes")
    return real(path)
_durability.sync_filesystem = marking
pool = ArtifactPool({str(tmp_path / "pool")!r})
with pool.batch(wait=False):
    pool.put(b"published just before exit")
"""
    import subprocess
    import sys

    began = time.monotonic()
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - began < 30
    assert marker.read_text() == "yes"
