"""A fan-out directory ``objects/<xx>``'s entry is durable when an object in it is: outside
a batch, ``objects/`` is fsynced once the directory is created (before the object's
journal entry), and after each publication into a directory that was already there
(another process's batch may have made it and not flushed yet); a batch leaves the
entries of the directories it made to its own flush (one ``syncfs``, else ``objects/``
after the files and their directories)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.errors import PoolError
from distcache.store import _durability
from distcache.store._fs import fsync_dir
from distcache.store._import import import_set
from distcache.store._pool import ArtifactPool

#: What happened, in order: ("fsync", path of the flushed descriptor), ("journal", sha).
Events = list[tuple[str, str]]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _blobs(prefixes: int, per_prefix: int) -> Iterator[bytes]:
    """``per_prefix`` blobs for each of ``prefixes`` distinct fan-out directories."""
    seen: dict[str, int] = {}
    i = 0
    while len([n for n in seen.values() if n >= per_prefix]) < prefixes:
        data = f"kernel {i}".encode()
        i += 1
        prefix = _sha(data)[:2]
        if seen.get(prefix, 0) >= per_prefix or (prefix not in seen and len(seen) >= prefixes):
            continue
        seen[prefix] = seen.get(prefix, 0) + 1
        yield data


def _record(pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch) -> Events:
    """Record every ``fsync`` (by the path of its descriptor) and journal append."""
    events: Events = []
    real_fsync = os.fsync
    real_append = pool._journal.append

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def append(sha: str) -> None:
        events.append(("journal", sha))
        real_append(sha)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(pool._journal, "append", append)
    return events


def _objects(pool: ArtifactPool) -> str:
    return os.path.realpath(pool.layout.objects)


def _fanout(pool: ArtifactPool, sha: str) -> str:
    return os.path.realpath(pool.layout.fanout(sha))


def _temps(events: Events, pool: ArtifactPool) -> Events:
    """``events`` with each fsync of a temporary file written as ("fsync", "tmp")."""
    tmp = os.path.realpath(pool.layout.root / "tmp") + os.sep
    return [("fsync", "tmp") if kind == "fsync" and path.startswith(tmp) else (kind, path)
            for kind, path in events]


def test_the_first_object_of_a_fanout_flushes_objects_before_it_is_journaled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    first, second = list(_blobs(1, 2))
    events = _record(pool, monkeypatch)
    sha = pool.put(first)
    assert _temps(events, pool) == [
        ("fsync", "tmp"),
        ("fsync", _objects(pool)),
        ("fsync", _fanout(pool, sha)),
        ("journal", sha),
    ]
    events.clear()
    # The same fan-out directory again: it existed, so objects/ is flushed after the
    # link, not before it.
    other = pool.put(second)
    assert _fanout(pool, other) == _fanout(pool, sha)
    assert _temps(events, pool) == [
        ("fsync", "tmp"),
        ("fsync", _fanout(pool, other)),
        ("fsync", _objects(pool)),
        ("journal", other),
    ]


def test_a_fanout_another_process_made_in_a_batch_is_flushed_by_a_publication_outside_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = list(_blobs(1, 2))
    other_process = ArtifactPool(tmp_path / "pool")  # a second instance: no shared state
    pool = ArtifactPool(tmp_path / "pool")
    events = _record(pool, monkeypatch)
    with other_process.batch(wait=False):
        other_process.put(first)  # makes objects/<xx>, leaves its entry to the flush
        assert ("fsync", _objects(pool)) not in events
        # This instance's publication outside a batch is durable when it returns: the
        # directory's entry too, though it did not make the directory.
        sha = pool.put(second)
        assert _temps(events, pool) == [
            ("fsync", "tmp"), ("fsync", _fanout(pool, sha)), ("fsync", _objects(pool)),
            ("journal", sha)]


@pytest.mark.parametrize("syncfs", [True, False])
def test_a_batch_leaves_its_new_fanouts_to_its_flush(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, syncfs: bool) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    blobs = list(_blobs(4, 3))
    old = pool.put(blobs[0])  # its fan-out directory exists before the batch
    if not syncfs:
        monkeypatch.setattr(_durability, "sync_filesystem", lambda path: False)
    events = _record(pool, monkeypatch)
    with pool.batch():
        shas = [pool.put(data) for data in blobs[1:]]
        inside = list(events)
    new = {_fanout(pool, s) for s in shas} - {_fanout(pool, old)}
    assert len(new) == 3
    # Inside the batch: no flush at all, only the journal entries.
    assert inside == [("journal", sha) for sha in shas]
    # The batch's flush: one syncfs, or each file, each directory, then objects/.
    after = events[len(inside):]
    if syncfs:
        assert after == []
    else:
        assert after == [("fsync", os.path.realpath(pool.layout.object_path(s))) for s in shas] + [
            ("fsync", d) for d in sorted({_fanout(pool, s) for s in shas})] + [
            ("fsync", _objects(pool))]


def test_a_batch_makes_256_fanouts_without_a_flush_of_objects_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    monkeypatch.setattr(_durability, "sync_filesystem", lambda path: False)
    events = _record(pool, monkeypatch)
    with pool.batch():
        shas = [pool.put(data) for data in _blobs(256, 2)]
        assert ("fsync", _objects(pool)) not in events
    assert len(shas) == 512
    assert len({s[:2] for s in shas}) == 256
    assert events.count(("fsync", _objects(pool))) == 1  # the batch's flush
    assert events[-1] == ("fsync", _objects(pool))


def test_a_publication_the_batch_ended_under_flushes_objects_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publication that began inside a batch which ended before it was recorded
    flushes itself, its directory and ``objects/``, which its directory's entry is in
    (it made the directory without a flush)."""
    pool = ArtifactPool(tmp_path / "pool")
    monkeypatch.setattr(_durability, "sync_filesystem", lambda path: False)
    data = b"published as its batch ends"
    sha = _sha(data)
    events = _record(pool, monkeypatch)
    # As when the last batch ended between the publication's check and its record.
    monkeypatch.setattr(pool._store._durability, "published", lambda path, size: False)
    with pool.batch():
        assert pool.put(data) == sha
    assert _temps(events, pool) == [
        ("fsync", os.path.realpath(pool.layout.object_path(sha))),
        ("fsync", _fanout(pool, sha)),
        ("fsync", _objects(pool)),
        ("journal", sha),
    ]


def test_importing_a_set_flushes_objects_once_with_its_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "set"
    blobs = list(_blobs(3, 2))
    for i, data in enumerate(blobs):
        (source / "k").mkdir(parents=True, exist_ok=True)
        (source / "k" / f"{i}.cubin").write_bytes(data)
    pool = ArtifactPool(tmp_path / "pool")
    monkeypatch.setattr(_durability, "sync_filesystem", lambda path: False)
    events = _record(pool, monkeypatch)
    report = import_set(pool, source)
    assert report.new_objects == len(blobs)
    journal = [sha for kind, sha in events if kind == "journal"]
    assert sorted(journal) == sorted(_sha(d) for d in blobs)
    # Three new fan-out directories, one flush of objects/: the batch's, after every
    # journal entry, every object and every fan-out directory.
    flushed = [i for i, event in enumerate(events) if event == ("fsync", _objects(pool))]
    last_journal = max(i for i, (kind, _) in enumerate(events) if kind == "journal")
    assert len(flushed) == 1 and flushed[0] > last_journal
    for sha in journal:
        assert events.index(("fsync", _fanout(pool, sha))) < flushed[0]
        assert ("fsync", os.path.realpath(pool.layout.object_path(sha))) in events


def test_a_fanout_recreated_after_a_planted_file_is_flushed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"an object whose fan-out name was taken by a file"
    sha = _sha(data)
    Path(pool.layout.fanout(sha)).write_bytes(b"not a directory")
    events = _record(pool, monkeypatch)
    assert pool.put(data) == sha
    assert stat.S_ISDIR(os.lstat(pool.layout.fanout(sha)).st_mode)
    assert _temps(events, pool) == [
        ("fsync", "tmp"),
        ("fsync", _objects(pool)),
        ("fsync", _fanout(pool, sha)),
        ("journal", sha),
    ]


def test_a_failed_flush_of_objects_publishes_nothing_and_is_retried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"an object whose new fan-out directory cannot be flushed"
    sha = _sha(data)
    objects = _objects(pool)
    real_fsync = os.fsync
    failed: list[int] = []

    def failing_on_objects(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == objects and not failed:
            failed.append(fd)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_on_objects)
    with pytest.raises(PoolError, match="Input/output error"):
        pool.put(data)
    assert pool._journal.since()[0] == []
    assert not pool.has(sha)
    # The directory that could not be made durable is gone: the next publication
    # creates it again, and flushes objects/ again.
    assert not os.path.lexists(pool.layout.fanout(sha))
    assert os.listdir(pool.layout.root / "tmp") == []
    events = _record(pool, monkeypatch)
    assert pool.put(data) == sha
    assert _temps(events, pool) == [
        ("fsync", "tmp"), ("fsync", objects), ("fsync", _fanout(pool, sha)), ("journal", sha)]


@pytest.mark.parametrize("failing", ["fanout", "objects"])
def test_a_failed_flush_after_the_link_withdraws_the_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """Outside a batch, a publication into a fan-out directory that was already there
    flushes that directory, then objects/ (the directory may be another process's,
    unflushed). When either flush fails the error is raised and nothing is left
    behind: an object left linked but unjournaled would be found by every later put,
    which journals nothing, so no sync would ever announce it."""
    pool = ArtifactPool(tmp_path / "pool")
    first, second = list(_blobs(1, 2))
    fanout = _fanout(pool, pool.put(first))
    flushed = fanout if failing == "fanout" else _objects(pool)
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == flushed:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(PoolError, match="Input/output error"):
        pool.put(second)
    assert pool._journal.since()[0] == [_sha(first)]
    assert os.path.isdir(fanout)  # not new: kept, with the object already in it
    assert not pool.has(_sha(second)) and pool.has(_sha(first))
    assert os.listdir(pool.layout.root / "tmp") == []
    # The next publication links it again and journals it.
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert pool.put(second) == _sha(second)
    assert pool._journal.since()[0] == [_sha(first), _sha(second)]


def test_a_directory_that_cannot_be_opened_for_its_flush_fails_the_publication(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors (or any error but a vanished directory) when opening a
    directory to flush it is a failed flush, not a flush skipped in silence."""
    pool = ArtifactPool(tmp_path / "pool")
    data = b"published while the process is out of descriptors"
    real_open = os.open

    def no_descriptors_for_directories(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECTORY and os.path.realpath(path) == _objects(pool):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_descriptors_for_directories)
    with pytest.raises(PoolError, match="Too many open files"):
        pool.put(data)
    assert pool._journal.since()[0] == []
    assert not pool.has(_sha(data))
    monkeypatch.setattr(os, "open", real_open)
    # A directory that is gone is still no error: there is nothing of it to flush.
    fsync_dir(tmp_path / "gone")



def _opening(root: Path, monkeypatch: pytest.MonkeyPatch) -> Events:
    """What ``ArtifactPool(root)`` does to directories while it opens (or creates) the
    pool, in order: ("mkdir", name under root) and ("fsync", path flushed)."""
    events: Events = []
    real_fsync, real_mkdir = os.fsync, os.mkdir

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def mkdir(path: str | os.PathLike[str], *args: int, **kwargs: int) -> None:
        real_mkdir(path, *args, **kwargs)
        events.append(("mkdir", os.path.relpath(path, root)))

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", fsync)
        patch.setattr(os, "mkdir", mkdir)
        ArtifactPool(root)
    return events


def test_a_new_pool_flushes_its_root_after_making_its_directories(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "pool"
    root.mkdir()
    events = _opening(root, monkeypatch)
    flushed_root = ("fsync", os.path.realpath(root))
    made = [i for i, (kind, name) in enumerate(events)
            if kind == "mkdir" and name in ("objects", "tmp", "quarantine", "locks")]
    assert len(made) == 4, events
    # The flush of the format file, before them, does not cover their entries.
    assert flushed_root in events[max(made):], events
    # Reopened: one directory made again, one flush of the root; then none.
    os.rmdir(root / "quarantine")
    again = _opening(root, monkeypatch)
    assert [e for e in again if e[0] == "mkdir"] == [("mkdir", "quarantine")]
    assert again[-1] == flushed_root and again.count(flushed_root) == 1, again
    assert [e for e in _opening(root, monkeypatch) if e[0] == "fsync"] == []
