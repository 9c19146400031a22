"""Edge cases of the pool's maintenance, identity and locking: concurrent removals,
odd entries, lock timeouts and lock files replaced under their holder."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest

from distcache.artifact import Artifact
from distcache.errors import PoolError
from distcache.store import _identity, _maintenance, _prune
from distcache.store._locking import FileLock
from distcache.store._pool import ArtifactPool
from distcache.store.layout import PoolLayout, scan_objects


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def pool(tmp_path: Path) -> ArtifactPool:
    return ArtifactPool(tmp_path / "pool")


def _aged(pool: ArtifactPool, blobs: list[bytes]) -> list[str]:
    """Publish ``blobs`` with ascending recency stamps (the first is the oldest)."""
    shas = []
    now = time.time()
    for i, data in enumerate(blobs):
        digest = pool.put(data)
        stamp = now - 1000 + i * 100
        os.utime(pool.layout.object_path(digest), (stamp, stamp))
        shas.append(digest)
    return shas


def test_gc_counts_an_object_another_process_removed_and_removes_no_more_than_needed(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    oldest, middle, newest = _aged(pool, [b"a" * 100, b"b" * 100, b"c" * 100])

    def racing(layout: PoolLayout, unlisted: list[tuple[str, OSError]] | None = None
               ) -> Iterator[tuple[str, str, os.stat_result]]:
        found = list(scan_objects(layout, unlisted))
        os.unlink(layout.object_path(oldest))  # another process's gc got there first
        return iter(found)

    monkeypatch.setattr(_maintenance, "scan_objects", racing)
    report = pool.gc(max_bytes=200)
    assert pool.has(middle) and pool.has(newest)
    assert (report.removed, report.freed_bytes) == (0, 0)
    assert (report.kept, report.kept_bytes) == (2, 200)


def test_verify_does_not_count_an_object_removed_meanwhile_as_corrupt(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone, good = _aged(pool, [b"gone" * 10, b"good" * 10])
    store = pool._store
    real_scan = store.scan

    def racing(unlisted: list[tuple[str, OSError]] | None = None
               ) -> Iterator[tuple[str, str, os.stat_result]]:
        found = list(real_scan(unlisted))
        os.unlink(pool.layout.object_path(gone))  # collected by another process
        return iter(found)

    monkeypatch.setattr(store, "scan", racing)
    report = pool.verify()
    assert (report.ok, report.corrupt, report.quarantined) == (1, 0, 0)
    assert pool.has(good) and pool.quarantined == 0


def test_verify_still_counts_a_corrupt_object_it_cannot_move_aside(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    (digest,) = _aged(pool, [b"x" * 50])
    path = pool.layout.object_path(digest)
    os.chmod(path, 0o644)
    Path(path).write_bytes(b"y" * 50)

    def refuse(*_args: object) -> bool:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("distcache.store._objects.move_aside", refuse)
    report = pool.verify()
    assert (report.ok, report.corrupt) == (0, 1)


def test_sweep_and_open_survive_a_directory_in_locks(pool: ArtifactPool) -> None:
    odd = pool.root / "locks" / "odd.lock"
    odd.mkdir()
    stale = pool.root / "locks" / f"{'0' * 64}.lock"
    stale.write_bytes(b"")
    old = time.time() - 7200
    os.utime(odd, (old, old))
    os.utime(stale, (old, old))
    assert pool.sweep() == 1
    assert odd.is_dir() and not stale.exists()
    ArtifactPool(pool.root)  # every open sweeps


def test_release_does_not_remove_a_lock_file_that_replaced_the_holders(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    first = FileLock(path, timeout=0, remove_on_release=True)
    assert first.acquire() and first.held
    os.unlink(path)  # an operator's cleanup removes the lock file under its holder
    second = FileLock(path, timeout=0, remove_on_release=True)
    assert second.acquire() and second.held
    first.release()
    assert path.exists()  # the second holder's file
    third = FileLock(path, timeout=0.1)
    assert not third.acquire()
    second.release()
    assert third.acquire()
    third.release()


def test_renew_does_not_replace_the_id_without_the_renewal_lock(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_identity, "_RENEW_LOCK_TIMEOUT", 0.1)
    before = pool.pool_id
    holder = FileLock(pool.layout.id_lock_path(), timeout=0)
    assert holder.acquire() and holder.held
    try:
        with pytest.raises(PoolError, match="renew"):
            pool.identity.renew()
    finally:
        holder.release()
    assert pool.layout.pool_id_file.read_text().strip() == before
    assert pool.pool_id == before
    renewed = pool.identity.renew()
    assert renewed != before
    assert pool.layout.pool_id_file.read_text().strip() == renewed


def test_renew_adopts_an_id_renewed_while_it_waited_for_the_lock(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_identity, "_RENEW_LOCK_TIMEOUT", 0.1)
    other = ArtifactPool(pool.root)
    renewed = other.identity.renew()
    holder = FileLock(pool.layout.id_lock_path(), timeout=0)
    assert holder.acquire()
    try:
        # Timing out on the lock, it still sees the id has moved on, and takes it.
        assert pool.identity.renew() == renewed
    finally:
        holder.release()


def test_prune_does_not_rewrite_the_labels_without_the_log_lock(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_prune, "_LOCK_WAIT", 0.1)
    digest = pool.put(b"labelled")
    pool.remember([Artifact("a", digest)])
    removal = _prune.plan_rm(pool, ["a"])
    before = pool.layout.names_log.read_bytes()
    fd = os.open(pool.layout.names_log, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # an appender holds the log
        with pytest.raises(PoolError, match="another process held it locked") as caught:
            _prune.apply(pool, removal)
        assert str(caught.value).count("cannot rewrite") == 1
    finally:
        os.close(fd)
    assert pool.layout.names_log.read_bytes() == before
    assert pool.has(digest)


def test_rm_keeps_an_object_a_label_recorded_since_the_plan_points_at(
    pool: ArtifactPool,
) -> None:
    digest = pool.put(b"shared bytes")
    pool.remember([Artifact("a", digest)])
    removal = _prune.plan_rm(pool, ["a"])
    assert digest in removal.objects
    ArtifactPool(pool.root).remember([Artifact("b", digest)])  # another process, meanwhile
    labels, deleted, freed = _prune.apply(pool, removal)
    assert (labels, deleted, freed) == (1, 0, 0)
    assert pool.has(digest) and pool.names() == {"b": digest}


class _Origin:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def describe(self) -> str:
        return "test://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        return self.data

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        out.write(self.data)
        return len(self.data)


def test_fetch_goes_on_without_the_lock_when_a_directory_is_at_the_lock_path(
    pool: ArtifactPool,
) -> None:
    data = b"downloaded"
    digest = sha(data)
    pool.layout.lock_path(digest).mkdir()
    assert pool.fetch(Artifact("model/w", digest), _Origin(data)) == data
    assert pool.has(digest)


def test_a_socket_at_a_lock_path_degrades_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "s.lock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        lock = FileLock(path, timeout=0)
        assert lock.acquire() and lock.degraded and not lock.held
    finally:
        server.close()


def test_a_capped_pool_keeps_the_object_it_just_published(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "p", max_bytes=100)
    older = pool.put(b"o" * 80)
    os.utime(pool.layout.object_path(older), (time.time() - 500, time.time() - 500))
    big = pool.put(b"b" * 150)  # more than the cap alone
    assert pool.has(big) and pool.get(big) == b"b" * 150
    assert not pool.has(older)  # the older object makes room


def test_prune_keeps_an_object_used_since_the_plan_and_its_labels(pool: ArtifactPool) -> None:
    used = pool.put(b"used again")
    idle = pool.put(b"idle")
    pool.remember([Artifact("used", used), Artifact("idle", idle)])
    old = time.time() - 10_000
    for digest in (used, idle):
        os.utime(pool.layout.object_path(digest), (old, old))
    removal = _prune.plan_prune(pool, older_than=3600)
    assert set(removal.objects) == {used, idle}
    assert pool.get(used) == b"used again"  # a reader stamps it while the operator confirms
    labels, deleted, freed = _prune.apply(pool, removal)
    assert (labels, deleted, freed) == (1, 1, len(b"idle"))
    assert pool.has(used) and not pool.has(idle)
    assert pool.names() == {"used": used}


def test_sweep_does_not_count_a_lock_file_it_could_not_remove(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = pool.root / "locks" / f"{'1' * 64}.lock"
    stale.write_bytes(b"")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    real_unlink = os.unlink

    def refusing(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if os.fspath(path) == str(stale):  # another user's file in a sticky directory
            raise PermissionError(1, "Operation not permitted", os.fspath(path))
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", refusing)
    assert pool.sweep() == 0
    assert stale.exists()


@pytest.mark.parametrize("err", [errno.ESTALE, errno.EIO])
def test_a_lock_file_that_cannot_be_examined_is_retried_or_refused_without_a_leak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    path = tmp_path / "e.lock"
    real_stat = os.stat
    failures = [err]

    def failing(target: object, *args: object, **kwargs: object) -> os.stat_result:
        if os.fspath(target) == str(path) and failures:  # type: ignore[arg-type]
            code = failures.pop()
            raise OSError(code, os.strerror(code), str(path))
        return real_stat(target, *args, **kwargs)  # type: ignore[arg-type]

    fds = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "stat", failing)
    lock = FileLock(path, timeout=0)
    if err == errno.ESTALE:  # removed on another client: start over on the path
        assert lock.acquire() and lock.held
        lock.release()
    else:
        with pytest.raises(PoolError, match="cannot examine lock file"):
            lock.acquire()
        assert not lock.held
    monkeypatch.setattr(os, "stat", real_stat)
    assert len(os.listdir("/proc/self/fd")) == fds
