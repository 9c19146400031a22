"""ArtifactPool in one process: layout, verification, quarantine, publication,
read-through fetch, materialize, labels, journal, LRU collection and maintenance."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import time
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from distcache.artifact import Artifact
from distcache.errors import ArtifactNameError, ConfigError, IntegrityError, OriginError, PoolError
from distcache.store._pool import ArtifactPool


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeOrigin:
    """Serves fixed blobs by sha and counts requests."""

    def __init__(self, *blobs: bytes, fail: Exception | None = None) -> None:
        self.blobs = {sha(b): b for b in blobs}
        self.calls: Counter[str] = Counter()
        self.fail = fail
        self.serve: dict[str, bytes] = {}

    def describe(self) -> str:
        return "fake://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        self.calls[artifact.sha256] += 1
        return self.blobs[artifact.sha256]

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        self.calls[artifact.sha256] += 1
        if self.fail is not None:
            out.write(b"partial")
            raise self.fail
        data = self.serve.get(artifact.sha256, self.blobs.get(artifact.sha256, b""))
        out.write(data)
        return len(data)


def forged(name: str, digest: str) -> Artifact:
    """An Artifact that skipped validation, as duck-typed callers may pass."""
    artifact = object.__new__(Artifact)
    object.__setattr__(artifact, "name", name)
    object.__setattr__(artifact, "sha256", digest)
    object.__setattr__(artifact, "size", None)
    return artifact


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def pool(tmp_path: Path) -> ArtifactPool:
    return ArtifactPool(tmp_path / "pool", lock_timeout=5)


DATA = b"cubin bytes " * 1000
DIGEST = sha(DATA)


# -- layout and publication ---------------------------------------------------------


def test_put_stores_read_only_object_at_content_address(pool: ArtifactPool) -> None:
    assert pool.put(DATA) == DIGEST
    path = pool.root / "objects" / DIGEST[:2] / DIGEST
    assert path.read_bytes() == DATA
    assert stat.S_IMODE(path.stat().st_mode) & 0o222 == 0
    assert pool.has(DIGEST)
    assert pool.get(DIGEST) == DATA
    assert list(pool.objects()) == [DIGEST]
    assert os.listdir(pool.root / "tmp") == []


def test_put_is_idempotent_and_journals_once(pool: ArtifactPool) -> None:
    assert pool.put(DATA) == pool.put(DATA, DIGEST) == DIGEST
    assert pool.journal_since(0)[0] == [DIGEST]
    assert pool.stats().objects == 1
    # The second writer's temporary file went too, though a good object was first.
    assert os.listdir(pool.root / "tmp") == []


def test_a_second_publisher_over_a_symlinked_fanout_quarantines_it_and_publishes(
    pool: ArtifactPool, tmp_path: Path
) -> None:
    # The fan-out directory is checked once per publish: a real one is used as it
    # is; anything else is moved aside and made again before the link.
    pool.put(DATA)
    fanout = pool.root / "objects" / DIGEST[:2]
    other = b"another object in the same fan-out directory"
    while sha(other)[:2] != DIGEST[:2]:
        other += b"."
    outside = tmp_path / "outside"
    outside.mkdir()
    (fanout / DIGEST).chmod(0o644)
    (fanout / DIGEST).unlink()
    fanout.rmdir()
    fanout.symlink_to(outside)
    assert pool.put(other) == sha(other)
    assert fanout.is_dir() and not fanout.is_symlink()
    assert os.listdir(outside) == [] and os.listdir(pool.root / "tmp") == []
    assert (fanout / sha(other)).read_bytes() == other


def test_put_with_wrong_digest_raises_and_stores_nothing(pool: ArtifactPool) -> None:
    with pytest.raises(IntegrityError) as info:
        pool.put(DATA, sha(b"other"))
    assert getattr(info.value, "actual", None) == DIGEST
    assert list(pool.objects()) == []
    assert os.listdir(pool.root / "tmp") == []


def test_missing_object_is_a_miss(pool: ArtifactPool) -> None:
    assert pool.get(DIGEST) is None
    assert not pool.has(DIGEST)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "", "A" * 64, DIGEST[:-1], DIGEST + "\0"])
def test_malformed_sha_is_rejected_before_touching_files(pool: ArtifactPool, bad: str) -> None:
    before = tree(pool.root)
    for call in (pool.get, pool.has):
        with pytest.raises(ValueError):
            call(bad)
    with pytest.raises(ValueError):
        pool.put(DATA, bad)
    assert tree(pool.root) == before


def test_pool_id_is_stable_across_opens(tmp_path: Path) -> None:
    first = ArtifactPool(tmp_path / "p").pool_id
    assert len(first) == 32
    assert ArtifactPool(tmp_path / "p").pool_id == first
    assert ArtifactPool(tmp_path / "other").pool_id != first


def test_pool_id_file_with_garbage_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "pool_id").write_text("not an id")
    with pytest.raises(PoolError):
        ArtifactPool(tmp_path / "p")


def test_root_that_is_a_file_raises_pool_error_with_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(PoolError) as info:
        ArtifactPool(tmp_path / "file" / "pool")
    assert isinstance(info.value, OSError)
    assert "file" in getattr(info.value, "path", "")


def test_symlinked_objects_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "p"
    root.mkdir()
    (root / "format").write_text("1\n")  # a pool's, not another tool's directory
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "objects")
    with pytest.raises(PoolError, match="not a directory"):
        ArtifactPool(root)


@pytest.mark.parametrize("listed", [False, True], ids=["lstat-each", "list-fanout"])
def test_holding_answers_as_has_for_each_object_and_never_through_a_link(
    pool: ArtifactPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: bool
) -> None:
    # From how many objects per fanout directory holding lists the directory.
    monkeypatch.setattr("distcache.store._objects._LISTED", 1 if listed else 10**9)
    present = [pool.put(b"one"), pool.put(b"two")]
    # A symlinked fanout whose target holds a regular file of the right name.
    linked = next(d for d in (sha(bytes([i])) for i in range(256))
                  if d[:2] not in {p[:2] for p in present})
    (tmp_path / "bait").mkdir()
    (tmp_path / "bait" / linked).write_bytes(b"bait")
    os.symlink(tmp_path / "bait", pool.root / "objects" / linked[:2])
    # An object path that is a directory, in a real fanout of a present object.
    odd = present[0][:2] + "f" * 62
    (pool.root / "objects" / odd[:2] / odd).mkdir()
    absent = sha(b"never stored")
    asked = [present[0], linked, absent, odd, present[1], present[0]]
    assert pool.holding(asked) == [pool.has(s) for s in asked]
    assert pool.holding(asked) == [True, False, False, False, True, True]
    assert pool.holding([]) == []
    with pytest.raises(ValueError):
        pool.holding([present[0], "not-a-sha"])


def test_holding_asks_object_by_object_where_a_fanout_cannot_be_listed(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fanout with search permission only (x, not r) answers has() but not a listing;
    # root ignores the mode bits, so the listing's refusal is made here.
    import distcache.store._objects as objects

    def refused(fanout: str, names: set[str]) -> set[str]:
        raise PermissionError(errno.EACCES, "Permission denied", fanout)

    monkeypatch.setattr(objects, "_LISTED", 1)
    monkeypatch.setattr(objects, "_regular_files", refused)
    present = pool.put(b"one")
    assert pool.holding([present, sha(b"absent")]) == [True, False]


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_non_directory_fanout_is_moved_aside_and_publishing_heals(
    pool: ArtifactPool, tmp_path: Path, planted: str
) -> None:
    (tmp_path / "elsewhere").mkdir()
    fanout = pool.root / "objects" / DIGEST[:2]
    if planted == "symlink":
        os.symlink(tmp_path / "elsewhere", fanout)
    else:
        fanout.write_bytes(b"stray")
    assert pool.get(DIGEST) is None  # a miss for readers, never followed
    assert pool.put(DATA) == DIGEST
    assert os.listdir(tmp_path / "elsewhere") == []
    assert stat.S_ISDIR(os.lstat(fanout).st_mode)
    assert pool.get(DIGEST) == DATA
    aside = [p for p in (pool.root / "quarantine").iterdir()]
    assert len(aside) == 1 and aside[0].name.startswith(DIGEST + ".")
    kind = os.lstat(aside[0]).st_mode
    assert stat.S_ISLNK(kind) if planted == "symlink" else stat.S_ISREG(kind)


def test_a_fanout_that_cannot_be_moved_aside_is_refused_on_publish(
    pool: ArtifactPool, tmp_path: Path
) -> None:
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", pool.root / "objects" / DIGEST[:2])
    # Nowhere to move it: the quarantine is gone and a file holds its name.
    os.rmdir(pool.root / "quarantine")
    (pool.root / "quarantine").write_bytes(b"not a directory")
    with pytest.raises(PoolError, match="not a directory"):
        pool.put(DATA)
    assert os.listdir(tmp_path / "elsewhere") == []
    assert os.path.islink(pool.root / "objects" / DIGEST[:2])


def test_setgid_root_gives_setgid_subdirectories(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o2775)
    pool = ArtifactPool(root)
    pool.put(DATA)
    for sub in ("objects", "tmp", "locks", "quarantine", f"objects/{DIGEST[:2]}"):
        assert (root / sub).stat().st_mode & stat.S_ISGID, sub


def test_umask_002_makes_logs_and_locks_group_writable(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        pool = ArtifactPool(tmp_path / "p")
        pool.remember([Artifact("a.cubin", DIGEST)])
        pool.put(DATA)
    finally:
        os.umask(old)
    assert stat.S_IMODE((pool.root / "names.log").stat().st_mode) == 0o664
    assert stat.S_IMODE((pool.root / "objects" / DIGEST[:2]).stat().st_mode) & 0o070 == 0o070
    assert stat.S_IMODE((pool.root / "objects" / DIGEST[:2] / DIGEST).stat().st_mode) == 0o444


# -- verification and quarantine ----------------------------------------------------


def _object(pool: ArtifactPool, digest: str = DIGEST) -> Path:
    return pool.root / "objects" / digest[:2] / digest


def _flip_byte(path: Path) -> None:
    os.chmod(path, 0o644)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    os.chmod(path, 0o644)
    os.truncate(path, path.stat().st_size // 2)


def _grow(path: Path) -> None:
    os.chmod(path, 0o644)
    with open(path, "ab") as f:
        f.write(b"trailing")


def _symlink_to_good_copy(path: Path) -> None:
    good = path.parent.parent.parent.parent / "good-copy"
    good.write_bytes(DATA)
    path.unlink()
    os.symlink(good, path)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_disk_full_while_the_origin_streams_is_a_pool_error_and_leaves_no_temp_file(
    tmp_path: Path,
) -> None:
    # The origin writes into the pool's temp file; ENOSPC from that write escaped as
    # a bare OSError instead of the PoolError that fetch documents.
    class FillsTheDisk:
        def describe(self) -> str:
            return "full://disk"

        def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
            out.write(b"part of the body")
            raise OSError(errno.ENOSPC, "No space left on device")

    pool = ArtifactPool(tmp_path / "pool")
    with pytest.raises(PoolError) as info:
        pool.fetch(Artifact("k.cubin", DIGEST), FillsTheDisk())
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(pool.root / "tmp") == []
    assert not pool.has(DIGEST)


def test_quarantine_keeps_only_the_newest_files(tmp_path: Path) -> None:
    # quarantine/ is outside the size cap: on a medium that keeps corrupting objects
    # it used to grow until the disk was full and every later write failed.
    pool = ArtifactPool(tmp_path / "pool")
    pool.quarantine_keep = 3
    shas = [pool.put(f"object {i}".encode()) for i in range(5)]
    for digest in shas:
        path = pool.root / "objects" / digest[:2] / digest
        os.chmod(path, 0o644)
        path.write_bytes(b"rot")
        assert pool.get(digest) is None
    assert pool.quarantined == 5
    kept = sorted(name.split(".")[0] for name in os.listdir(pool.root / "quarantine"))
    assert kept == sorted(shas[-3:])


@pytest.mark.parametrize(
    "damage", [_flip_byte, _truncate, _grow, _symlink_to_good_copy, _directory, _fifo]
)
def test_corrupt_object_is_quarantined_and_refetched(
    pool: ArtifactPool, damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    pool.put(DATA)
    damage(_object(pool))  # type: ignore[operator]
    caplog.set_level(logging.WARNING, logger="distcache.store._pool")
    assert pool.get(DIGEST) is None
    assert pool.quarantined == 1
    assert len(os.listdir(pool.root / "quarantine")) == 1
    assert not os.path.lexists(_object(pool))
    assert any("treated as a miss" in r.getMessage() for r in caplog.records)
    origin = FakeOrigin(DATA)
    assert pool.fetch(Artifact("k.cubin", DIGEST), origin) == DATA
    assert origin.calls[DIGEST] == 1
    assert pool.get(DIGEST) == DATA
    assert pool.stats().quarantined == 1


def test_fetch_never_returns_corrupt_bytes_of_a_present_object(pool: ArtifactPool) -> None:
    pool.put(DATA)
    _flip_byte(_object(pool))
    origin = FakeOrigin(DATA)
    assert pool.fetch(Artifact("k.cubin", DIGEST), origin) == DATA
    assert origin.calls[DIGEST] == 1
    assert pool.quarantined == 1


def test_put_repairs_a_corrupt_object(pool: ArtifactPool) -> None:
    pool.put(DATA)
    _truncate(_object(pool))
    assert pool.put(DATA) == DIGEST
    assert pool.get(DIGEST) == DATA
    assert pool.quarantined == 1


def test_verify_counts_ok_and_corrupt(pool: ArtifactPool) -> None:
    blobs = [bytes([i]) * (100 + i) for i in range(5)]
    digests = [pool.put(b) for b in blobs]
    _flip_byte(_object(pool, digests[0]))
    _truncate(_object(pool, digests[1]))
    report = pool.verify()
    assert (report.ok, report.corrupt, report.quarantined) == (3, 2, 2)
    assert report.ok_bytes == sum(len(b) for b in blobs[2:])
    assert pool.verify().corrupt == 0


# -- read-through fetch -------------------------------------------------------------


def test_fetch_miss_downloads_once_then_hits(pool: ArtifactPool) -> None:
    origin = FakeOrigin(DATA)
    artifact = Artifact("fmha//k.cubin", DIGEST, len(DATA))
    assert pool.fetch(artifact, origin) == DATA
    assert pool.fetch(artifact, origin) == DATA
    assert origin.calls[DIGEST] == 1
    assert pool.names() == {"fmha/k.cubin": DIGEST}
    assert pool.journal_since(0)[0] == [DIGEST]
    assert os.listdir(pool.root / "tmp") == []
    assert os.listdir(pool.root / "locks") == []


def test_fetch_rejects_origin_bytes_with_wrong_digest(pool: ArtifactPool) -> None:
    origin = FakeOrigin(DATA)
    origin.serve[DIGEST] = b"evil"
    with pytest.raises(IntegrityError) as info:
        pool.fetch(Artifact("k.cubin", DIGEST), origin)
    assert getattr(info.value, "source", None) == "fake://origin"
    assert not pool.has(DIGEST)
    assert os.listdir(pool.root / "tmp") == []


def test_fetch_rejects_wrong_size(pool: ArtifactPool) -> None:
    with pytest.raises(IntegrityError):
        pool.fetch(Artifact("k.cubin", DIGEST, len(DATA) + 1), FakeOrigin(DATA))
    assert not pool.has(DIGEST)


def test_origin_error_passes_through_and_leaves_nothing(pool: ArtifactPool) -> None:
    origin = FakeOrigin(fail=OriginError("404 from fake", status=404))
    with pytest.raises(OriginError) as info:
        pool.fetch(Artifact("k.cubin", DIGEST), origin)
    assert getattr(info.value, "status", None) == 404
    assert not pool.has(DIGEST)
    assert os.listdir(pool.root / "tmp") == []
    assert os.listdir(pool.root / "locks") == []


def test_fetch_accepts_an_origin_that_rewinds_after_a_failed_attempt(pool: ArtifactPool) -> None:
    class Rewinding(FakeOrigin):
        def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
            start = out.tell()
            out.write(b"garbage from a cut-off attempt")
            out.seek(start)
            out.truncate()
            out.write(DATA)
            return len(DATA)

    assert pool.fetch(Artifact("k.cubin", DIGEST), Rewinding()) == DATA


def test_fetch_waits_then_downloads_itself_when_lock_times_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from distcache.store._locking import FileLock

    pool = ArtifactPool(tmp_path / "p", lock_timeout=0.05)
    holder = FileLock(pool.root / "locks" / f"{DIGEST}.lock", timeout=1)
    assert holder.acquire()
    try:
        origin = FakeOrigin(DATA)
        assert pool.fetch(Artifact("k.cubin", DIGEST), origin) == DATA
        assert origin.calls[DIGEST] == 1
    finally:
        holder.release()
    assert any("downloading it too" in r.getMessage() for r in caplog.records)


# -- materialize ----------------------------------------------------------------------


def test_materialize_hard_links_into_dir(pool: ArtifactPool, tmp_path: Path) -> None:
    pool.put(DATA)
    target = pool.materialize(Artifact("fmha//trtllm/k.cubin", DIGEST), tmp_path / "rank0")
    assert target == tmp_path / "rank0" / "fmha" / "trtllm" / "k.cubin"
    assert target.read_bytes() == DATA
    assert target.stat().st_ino == _object(pool).stat().st_ino
    assert pool.materialize(Artifact("fmha/trtllm/k.cubin", DIGEST), tmp_path / "rank0") == target
    assert [p.name for p in target.parent.iterdir()] == ["k.cubin"]


def test_materialize_replaces_wrong_target_and_symlink_without_following(
    pool: ArtifactPool, tmp_path: Path
) -> None:
    pool.put(DATA)
    into = tmp_path / "into"
    into.mkdir()
    (into / "wrong.cubin").write_bytes(b"stale bytes")
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not touch")
    os.symlink(victim, into / "link.cubin")
    for name in ("wrong.cubin", "link.cubin"):
        target = pool.materialize(Artifact(name, DIGEST), into)
        assert not target.is_symlink()
        assert target.read_bytes() == DATA
    assert victim.read_bytes() == b"do not touch"


def test_materialize_keeps_an_existing_correct_copy(pool: ArtifactPool, tmp_path: Path) -> None:
    pool.put(DATA)
    (tmp_path / "k.cubin").write_bytes(DATA)
    before = (tmp_path / "k.cubin").stat().st_ino
    pool.materialize(Artifact("k.cubin", DIGEST), tmp_path)
    assert (tmp_path / "k.cubin").stat().st_ino == before


def test_materialize_copies_atomically_across_filesystems(
    pool: ArtifactPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool.put(DATA)

    def cross_device(src: str, dst: str) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    target = pool.materialize(Artifact("a/k.cubin", DIGEST), tmp_path / "other-fs")
    assert target.read_bytes() == DATA
    assert target.stat().st_nlink == 1
    assert sorted(os.listdir(target.parent)) == ["k.cubin"]


def test_materialize_of_absent_object_raises(pool: ArtifactPool, tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="fetch it first"):
        pool.materialize(Artifact("k.cubin", DIGEST), tmp_path / "into")


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/etc/passwd", "a/\0b", "a/../../b", "a\\..\\b", "a/./b", ""]
)
def test_hostile_names_are_rejected_before_any_filesystem_access(
    pool: ArtifactPool, tmp_path: Path, name: str
) -> None:
    pool.put(DATA)
    before = tree(tmp_path)
    with pytest.raises(ArtifactNameError):
        pool.materialize(forged(name, DIGEST), tmp_path / "into")
    with pytest.raises(ArtifactNameError):
        pool.remember([forged(name, DIGEST)])
    assert tree(tmp_path) == before
    assert pool.names() == {}


def test_symlinked_directory_inside_into_dir_is_not_followed(
    pool: ArtifactPool, tmp_path: Path
) -> None:
    pool.put(DATA)
    into = tmp_path / "into"
    into.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, into / "fmha")
    with pytest.raises(PoolError, match="refusing to write through"):
        pool.materialize(Artifact("fmha/k.cubin", DIGEST), into)
    assert os.listdir(outside) == []


# -- labels and journal -------------------------------------------------------------


def test_names_last_record_wins_and_other_instances_see_them(pool: ArtifactPool) -> None:
    other = sha(b"other")
    pool.remember([Artifact("a.cubin", DIGEST), Artifact("b.cubin", DIGEST)])
    pool.remember([Artifact("a.cubin", other)])
    pool.remember([Artifact("a.cubin", other)])  # unchanged: not written again
    assert pool.names() == {"a.cubin": other, "b.cubin": DIGEST}
    assert ArtifactPool(pool.root).names() == {"a.cubin": other, "b.cubin": DIGEST}
    assert (pool.root / "names.log").read_text().count("a.cubin") == 2


def test_names_tolerate_torn_and_damaged_records(pool: ArtifactPool) -> None:
    pool.remember([Artifact("a.cubin", DIGEST)])
    log = pool.root / "names.log"
    with open(log, "ab") as f:
        f.write(f"\n{sha(b'x')} 00000000 forged.cubin\n".encode())  # bad checksum
        f.write(f"\n{sha(b'y')} 1234".encode())  # torn: a writer died mid-record
    assert pool.names() == {"a.cubin": DIGEST}
    pool.remember([Artifact("b.cubin", DIGEST)])
    assert ArtifactPool(pool.root).names() == {"a.cubin": DIGEST, "b.cubin": DIGEST}


def test_a_new_process_confirms_recorded_labels_without_writing_and_sees_damage(
    pool: ArtifactPool,
) -> None:
    """A process that has not read the log compares it as text. A damaged last record
    sends it to the parse (which finds an earlier good record, or writes the label
    again), and so does a label that names another sha."""
    other = sha(b"other")
    pool.remember([Artifact("a.cubin", DIGEST), Artifact("b.cubin", DIGEST)])
    log = pool.root / "names.log"
    size = log.stat().st_size
    ArtifactPool(pool.root).remember([Artifact("a.cubin", DIGEST), Artifact("b.cubin", DIGEST)])
    assert log.stat().st_size == size  # held: nothing appended
    with open(log, "ab") as f:  # b's last record: the right sha, a damaged checksum
        f.write(f"{DIGEST} 00000000 b.cubin\n".encode())
    fresh = ArtifactPool(pool.root)
    fresh.remember([Artifact("a.cubin", DIGEST), Artifact("b.cubin", DIGEST)])
    # Parsed instead: b's earlier record still holds, so nothing is appended either.
    assert log.stat().st_size == size + 74 + len("b.cubin") + 1
    assert fresh.names() == {"a.cubin": DIGEST, "b.cubin": DIGEST}
    ArtifactPool(pool.root).remember([Artifact("a.cubin", other)])
    assert ArtifactPool(pool.root).names() == {"a.cubin": other, "b.cubin": DIGEST}
    only_damaged = ArtifactPool(pool.root.parent / "second")
    with open(only_damaged.root / "names.log", "ab") as f:
        f.write(f"{DIGEST} 00000000 c.cubin\n".encode())
    ArtifactPool(only_damaged.root).remember([Artifact("c.cubin", DIGEST)])
    assert ArtifactPool(only_damaged.root).names() == {"c.cubin": DIGEST}


def test_confirming_labels_reads_only_what_was_appended_since_and_names_as_the_parse(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.store import _names
    from distcache.store._log import _name_record

    first, second = sha(b"first"), sha(b"second")
    pool.remember([Artifact("a/b.cubin", first)])
    reads: list[int] = []
    real_read = _names.read_checked

    def counted(path: Path, offset: int, tail: bytes) -> Any:
        read = real_read(path, offset, tail)
        reads.append(len(read[0]))
        return read

    monkeypatch.setattr(_names, "read_checked", counted)
    fresh = ArtifactPool(pool.root)
    fresh.remember([Artifact("a/b.cubin", first)])  # the whole log, once
    fresh.remember([Artifact("a/b.cubin", first)])  # nothing appended since: no record
    assert reads == [1, 0]
    # A record another writer spelled with '//' names a/b.cubin for the parse: the
    # label is now `second`, and confirming `first` must write it again.
    with open(pool.root / "names.log", "a") as f:
        f.write(_name_record("a//b.cubin", second) + "\n")
    assert ArtifactPool(pool.root).names() == {"a/b.cubin": second}
    ArtifactPool(pool.root).remember([Artifact("a/b.cubin", first)])
    assert ArtifactPool(pool.root).names() == {"a/b.cubin": first}


def test_journal_since_returns_new_shas_and_cursor(pool: ArtifactPool) -> None:
    first = pool.put(b"one")
    shas, cursor = pool.journal_since(0)
    assert shas == [first]
    assert pool.journal_since(cursor) == ([], cursor)
    other = ArtifactPool(pool.root)
    second = other.put(b"two")
    shas, cursor2 = pool.journal_since(cursor)
    assert shas == [second]
    assert cursor2 > cursor


def test_journal_tolerates_a_torn_last_line(pool: ArtifactPool) -> None:
    first = pool.put(b"one")
    with open(pool.root / "journal.log", "ab") as f:
        f.write(b"\n" + sha(b"two")[:20].encode())  # torn
    shas, cursor = pool.journal_since(0)
    assert shas == [first]
    assert pool.journal_since(cursor)[0] == []
    third = pool.put(b"three")
    assert pool.journal_since(cursor)[0] == [third]


def test_journal_cursor_past_end_restarts(pool: ArtifactPool) -> None:
    first = pool.put(b"one")
    assert pool.journal_since(10**9)[0] == [first]


# -- LRU collection -----------------------------------------------------------------


def _age(pool: ArtifactPool, digest: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(_object(pool, digest), (t, t))


def test_gc_removes_least_recently_used_first(pool: ArtifactPool) -> None:
    blobs = [bytes([i]) * 1000 for i in range(4)]
    digests = [pool.put(b) for b in blobs]
    for i, digest in enumerate(digests):
        _age(pool, digest, 1000 - i * 100)  # digests[0] is the oldest
    assert pool.get(digests[0]) == blobs[0]  # a read makes it the newest
    report = pool.gc(2000)
    assert (report.removed, report.freed_bytes, report.kept, report.kept_bytes) == (
        2,
        2000,
        2,
        2000,
    )
    assert {d for d in digests if pool.has(d)} == {digests[0], digests[3]}


def test_recent_stamp_is_not_rewritten_on_every_read(pool: ArtifactPool) -> None:
    pool.put(DATA)
    _age(pool, DIGEST, 10)  # younger than stamp_interval
    before = _object(pool).stat().st_mtime_ns
    pool.get(DIGEST)
    assert _object(pool).stat().st_mtime_ns == before


def test_gc_without_cap_removes_nothing(pool: ArtifactPool) -> None:
    pool.put(DATA)
    report = pool.gc()
    assert report.removed == 0 and report.max_bytes is None
    assert pool.has(DIGEST)


def test_max_bytes_cap_collects_on_publish(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "p", max_bytes=2500)
    digests = []
    for i in range(5):
        digests.append(pool.put(bytes([i]) * 1000))
        _age(pool, digests[-1], 1000 - i * 100)
    assert pool.stats().bytes <= 2500
    assert pool.has(digests[-1])
    assert not pool.has(digests[0])


def test_a_capped_pool_keeps_a_whole_batch_and_collects_once_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from distcache.store import _maintenance

    pool = ArtifactPool(tmp_path / "p", max_bytes=2500)
    old = [pool.put(bytes([100 + i]) * 1000) for i in range(2)]
    for i, digest in enumerate(old):
        _age(pool, digest, 2000 - i * 100)
    passes: list[int] = []
    real_gc = _maintenance.gc

    def counted(*args: object, **kwargs: object) -> object:
        passes.append(1)
        return real_gc(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_maintenance, "gc", counted)
    # An import or a prefetch: four objects, 4000 bytes, more than the cap alone.
    with caplog.at_level(logging.WARNING), pool.batch():
        fresh = [pool.put(bytes([i]) * 1000) for i in range(4)]
        assert passes == [] and all(pool.has(d) for d in fresh + old)  # nothing yet
    assert passes == [1]  # one collection, when the batch ended
    assert all(pool.has(d) for d in fresh)  # the whole set is kept...
    assert not any(pool.has(d) for d in old)  # ...the older objects make room
    assert any("more than its cap" in r.getMessage() for r in caplog.records)
    # Outside a batch the cap applies as before: the oldest goes.
    for i, digest in enumerate(fresh):
        _age(pool, digest, 1000 - i * 100)
    newest = pool.put(b"z" * 1000)
    assert pool.has(newest) and not pool.has(fresh[0])
    assert pool.stats().bytes <= 2500


def test_config_from_environment_and_explicit_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISTCACHE_POOL_MAX_BYTES", "64M")
    monkeypatch.setenv("DISTCACHE_LOCK_TIMEOUT", "7")
    from_env = ArtifactPool(tmp_path / "p")
    assert (from_env.max_bytes, from_env.lock_timeout) == (64 << 20, 7.0)
    explicit = ArtifactPool(tmp_path / "p", max_bytes=0, lock_timeout=0)
    assert (explicit.max_bytes, explicit.lock_timeout) == (0, 0)
    monkeypatch.setenv("DISTCACHE_LOCK_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="DISTCACHE_LOCK_TIMEOUT"):
        ArtifactPool(tmp_path / "p")
    with pytest.raises(ConfigError):
        ArtifactPool(tmp_path / "p", max_bytes=-1, lock_timeout=1)


# -- maintenance ----------------------------------------------------------------------


def test_sweep_removes_stale_temp_and_lock_files_only(pool: ArtifactPool) -> None:
    stale = pool.root / "tmp" / "dead.host.1.abc.tmp"
    fresh = pool.root / "tmp" / "live.host.2.abc.tmp"
    stale_lock = pool.root / "locks" / f"{DIGEST}.lock"
    for path in (stale, fresh, stale_lock):
        path.write_bytes(b"x")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    os.utime(stale_lock, (old, old))
    assert pool.sweep() == 2
    assert fresh.exists() and not stale.exists() and not stale_lock.exists()
    assert pool.stats().tmp_files == 1


def test_sweep_skips_a_file_another_sweeper_removed_and_still_removes_the_rest(
    pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every process opening a shared pool sweeps it; one that loses the race for a
    # file must not give up on the whole directory.
    old = time.time() - 7200
    paths = [pool.root / "tmp" / f"dead.host.{i}.abc.tmp" for i in range(3)]
    for path in paths:
        path.write_bytes(b"x")
        os.utime(path, (old, old))
    real_scandir = os.scandir

    class Racing:
        def __init__(self, directory: str | os.PathLike[str]) -> None:
            self._it = real_scandir(directory)

        def __enter__(self) -> Racing:
            return self

        def __exit__(self, *exc: object) -> None:
            self._it.close()

        def __iter__(self) -> Racing:
            return self

        def __next__(self) -> os.DirEntry[str]:
            entry = next(self._it)
            if entry.name == paths[0].name:
                os.unlink(entry.path)  # the other sweeper got there first
            return entry

    monkeypatch.setattr(os, "scandir", Racing)
    removed = pool.sweep()
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert not any(p.exists() for p in paths)
    assert removed == 2


def test_stale_temp_files_are_swept_when_the_pool_opens(pool: ArtifactPool) -> None:
    stale = pool.root / "tmp" / "dead.tmp"
    stale.write_bytes(b"half a download")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    ArtifactPool(pool.root)
    assert not stale.exists()


def test_stats_report_counts(pool: ArtifactPool) -> None:
    pool.put(DATA)
    pool.put(b"small")
    pool.remember([Artifact("a", DIGEST)])
    stats = pool.stats()
    assert (stats.objects, stats.bytes, stats.names) == (2, len(DATA) + 5, 1)
    assert stats.pool_id == pool.pool_id and stats.root == pool.root
