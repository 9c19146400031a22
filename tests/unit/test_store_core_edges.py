"""Edge cases of the pool's core: log appends under a held lock, materializing an
object replaced after its verification or owned by another user, and directory
sources changed while read."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
import threading
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.errors import ConfigError, PoolError
from distcache.store import _log, _materialize, _sources
from distcache.store._log import AppendLog
from distcache.store._pool import ArtifactPool


def test_append_log_past_a_held_lock_writes_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # A record the logs lose costs a later lookup; a failed append would fail the
    # publication it records: past the wait the append goes on, and says so.
    monkeypatch.setattr(_log, "_APPEND_LOCK_WAIT", 0.2)
    path = tmp_path / "journal.log"
    log = AppendLog(path, 0o666)
    holder = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger="distcache"):
            log.append(["a" * 64])
    finally:
        os.close(holder)
    assert path.read_bytes() == b"\n" + b"a" * 64 + b"\n"
    assert any("appending without it" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("swap", ["symlink", "other file"])
def test_materialize_never_places_an_object_replaced_after_its_verification(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"good kernel " * 1000
    sha = pool.put(data)
    planted = tmp_path / "planted"
    planted.write_bytes(b"evil kernel " * 1000)
    store = pool._store
    real_read = store.read

    def read_then_swap(sha_: str, **kwargs: bool) -> bytes | None:
        got = real_read(sha_, **kwargs)
        obj = store.layout.object_path(sha_)
        os.unlink(obj)
        if swap == "symlink":
            os.symlink(planted, obj)
        else:
            os.link(planted, obj)
        return got

    monkeypatch.setattr(store, "read", read_then_swap)
    target = pool.materialize(Artifact("k/k.cubin", sha, len(data)), tmp_path / "engine")
    assert not target.is_symlink()
    assert target.read_bytes() == data
    assert os.stat(target).st_ino != os.stat(planted).st_ino
    assert planted.read_bytes() == b"evil kernel " * 1000


def test_materialize_copies_an_object_owned_by_another_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"teammate's kernel " * 100
    sha = pool.put(data)
    obj = pool.layout.object_path(sha)
    owner = os.stat(obj).st_uid
    # This process runs as someone else than the object's owner, who can rewrite it.
    monkeypatch.setattr(_materialize.os, "geteuid", lambda: owner + 1)
    target = pool.materialize(Artifact("k.cubin", sha, len(data)), tmp_path / "engine")
    assert target.read_bytes() == data
    assert os.stat(target).st_ino != os.stat(obj).st_ino


def test_directory_source_swapped_for_a_fifo_is_refused_not_blocked_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "set"
    source.mkdir()
    member = source / "a.cubin"
    member.write_bytes(b"x" * 100)
    real_lstat = os.lstat
    swapped: list[bool] = []

    def lstat_then_swap(path: str, *args: object, **kwargs: object) -> os.stat_result:
        st = real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]
        if os.fspath(path) == str(member) and not swapped:
            swapped.append(True)
            os.unlink(member)
            os.mkfifo(member)
        return st

    monkeypatch.setattr(_sources.os, "lstat", lstat_then_swap)
    outcome: list[BaseException | None] = []

    def read_all() -> None:
        try:
            list(_sources.members(source, "dir", lambda _p: True, digest=True))
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(5.0)
    if reader.is_alive():  # blocked in open(): a writer releases it, then fail
        os.close(os.open(member, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5.0)
        pytest.fail("reading the source blocked on a FIFO")
    assert swapped
    assert isinstance(outcome[0], ConfigError)
    assert "a.cubin" in str(outcome[0])


def test_put_over_a_corrupt_object_that_keeps_coming_back_is_an_error_not_success(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"the real bytes " * 50
    sha = hashlib.sha256(data).hexdigest()
    obj = Path(pool.layout.object_path(sha))
    obj.parent.mkdir(parents=True, exist_ok=True)
    obj.write_bytes(b"corrupt")
    store = pool._store
    real_quarantine = store.quarantine

    def quarantine_and_replant(*args: object, **kwargs: object) -> None:
        real_quarantine(*args, **kwargs)  # type: ignore[arg-type]
        obj.write_bytes(b"corrupt again")  # another writer puts a bad file back

    monkeypatch.setattr(store, "quarantine", quarantine_and_replant)
    with pytest.raises(PoolError, match=sha):
        pool.put(data)
    monkeypatch.setattr(store, "quarantine", real_quarantine)
    assert pool.get(sha) is None  # what the error said: not published
    assert os.listdir(pool.layout.root / "tmp") == []


def test_a_directory_flush_that_fails_is_reported_not_taken_as_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    real_fsync = os.fsync

    def failing_on_directories(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_on_directories)
    with pytest.raises(PoolError, match="Input/output error"):
        pool.put(b"an object whose directory entry is not flushed")
