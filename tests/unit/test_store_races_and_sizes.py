"""The pool under sizes and interleavings that break naive code: a huge file at an
object's name, an object collected between its verified read and its link, a stale
quarantine racing a repair, and an export built inside its directory that was
interrupted or killed. Each race is replayed at the exact step it needs."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, parse_checksums
from distcache.errors import PoolError
from distcache.store import ArtifactPool, _fs, _materialize, _mirror, _reading
from distcache.store._export import export_directory


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bytes(size: int) -> bytes:
    """``size`` bytes that are not all alike (an object's name is their sha256)."""
    return (hashlib.sha256(str(size).encode()).digest() * (size // 32 + 1))[:size]


# --- 1: a huge file at an object's name ------------------------------------------------

SMALL_LARGE = 1 << 20  # what counts as large in these tests
CHUNK = 64 << 10


@pytest.fixture
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reading, "LARGE_FILE", SMALL_LARGE)
    monkeypatch.setattr(_fs, "CHUNK_BYTES", CHUNK, raising=False)


@contextmanager
def _reads(monkeypatch: pytest.MonkeyPatch, memory: int) -> Iterator[list[int]]:
    """Record how many bytes each read asks for; a read that asks for more than
    ``memory`` fails as an allocation of that size would where memory is short."""
    asked: list[int] = []

    def guard(size: int) -> None:
        asked.append(size)
        if size > memory:
            raise MemoryError(f"{size} bytes")

    real_read, real_pread, real_preadv = os.read, os.pread, os.preadv

    def read(fd: int, size: int) -> bytes:
        guard(size)
        return real_read(fd, size)

    def pread(fd: int, size: int, offset: int) -> bytes:
        guard(size)
        return real_pread(fd, size, offset)

    def preadv(fd: int, buffers: list[Any], offset: int, *flags: int) -> int:
        guard(sum(len(b) for b in buffers))
        return real_preadv(fd, buffers, offset, *flags)

    with monkeypatch.context() as patch:
        patch.setattr(os, "read", read)
        patch.setattr(os, "pread", pread)
        patch.setattr(os, "preadv", preadv)
        yield asked


def _plant_sparse(pool: ArtifactPool, size: int) -> tuple[str, str]:
    name = "ab" + "0" * 62
    path = pool.layout.object_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return name, path


@pytest.mark.usefixtures("small_limits")
def test_get_quarantines_a_huge_wrong_file_without_reading_it_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    name, path = _plant_sparse(pool, 16 * SMALL_LARGE)
    with _reads(monkeypatch, memory=SMALL_LARGE) as asked:
        assert pool.get(name) is None
        assert pool.get(name) is None  # the next lookup is a plain miss
    assert max(asked) <= CHUNK
    assert not os.path.lexists(path)
    assert pool.quarantined == 1
    assert len(os.listdir(pool.layout.quarantine)) == 1


@pytest.mark.usefixtures("small_limits")
def test_verify_hashes_in_chunks_and_quarantines_a_huge_wrong_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    good = _bytes(3 * SMALL_LARGE + 5)
    pool.put(good)
    _name, path = _plant_sparse(pool, 16 * SMALL_LARGE)
    with _reads(monkeypatch, memory=SMALL_LARGE) as asked:
        report = pool.verify()
    assert (report.ok, report.corrupt, report.quarantined) == (1, 1, 1)
    assert report.ok_bytes == len(good)
    assert max(asked) <= CHUNK  # no file is held whole, good or bad
    assert not os.path.lexists(path)
    assert pool.verify().corrupt == 0


@pytest.mark.usefixtures("small_limits")
def test_a_large_good_object_is_still_returned(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    good = _bytes(3 * SMALL_LARGE + 7)
    sha = pool.put(good)
    assert ArtifactPool(tmp_path / "pool").get(sha) == good
    assert pool.get(sha, trust_own=True) == good
    assert pool.quarantined == 0


@pytest.mark.usefixtures("small_limits")
def test_a_large_object_this_process_verified_is_not_hashed_in_chunks_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    good = _bytes(3 * SMALL_LARGE)
    sha = pool.put(good)  # verified as it was written: trusted while its file is unchanged
    chunked: list[int] = []
    real = _reading.hash_fd
    monkeypatch.setattr(_reading, "hash_fd", lambda fd, size: chunked.append(size) or real(
        fd, size))
    assert pool.get(sha, trust_own=True) == good
    assert chunked == []  # a trusted read of a large object: not hashed twice
    assert ArtifactPool(tmp_path / "pool").get(sha) == good  # another reader checks it first
    assert chunked == [len(good)]


@pytest.mark.usefixtures("small_limits")
def test_a_large_file_grown_or_altered_is_quarantined(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    good = _bytes(2 * SMALL_LARGE)
    sha = pool.put(good)
    path = pool.layout.object_path(sha)
    os.chmod(path, 0o644)
    with open(path, "ab") as f:
        f.write(b"x")
    reader = ArtifactPool(tmp_path / "pool")
    assert reader.get(sha) is None
    assert reader.quarantined == 1


# --- 2: the object collected between its verified read and its link ---------------------


@pytest.mark.parametrize("how", ["collected", "stale handle"])
def test_materialize_copies_the_verified_bytes_when_the_object_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"cubin" * 1000
    sha = pool.put(data)
    obj = pool.layout.object_path(sha)
    if how == "collected":  # another process's gc runs right after the read
        real = _materialize._ensure_dirs

        def ensure(into: Path, parent: Path) -> None:
            real(into, parent)
            os.unlink(obj)

        monkeypatch.setattr(_materialize, "_ensure_dirs", ensure)
    else:
        real_link = os.link

        def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if os.fspath(src) == obj:
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), obj)
            real_link(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "link", link)
    target = pool.materialize(Artifact("k/a.cubin", sha, len(data)), tmp_path / "out")
    assert target.read_bytes() == data
    assert os.stat(target).st_nlink == 1
    assert [p.name for p in target.parent.iterdir()] == ["a.cubin"]  # no temporary left


@pytest.mark.parametrize("existing", [b"old kernel", b"cubin" * 1000])
def test_materialize_over_an_existing_target_when_the_object_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bytes) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"cubin" * 1000
    sha = pool.put(data)
    obj = pool.layout.object_path(sha)
    target = tmp_path / "out" / "k" / "a.cubin"
    target.parent.mkdir(parents=True)
    target.write_bytes(existing)
    real = _materialize._ensure_dirs

    def ensure(into: Path, parent: Path) -> None:
        real(into, parent)
        os.unlink(obj)

    monkeypatch.setattr(_materialize, "_ensure_dirs", ensure)
    assert pool.materialize(Artifact("k/a.cubin", sha), tmp_path / "out") == target
    assert target.read_bytes() == data


# --- 3: a stale quarantine racing a repair ----------------------------------------------


def _repair_at_rename(monkeypatch: pytest.MonkeyPatch, path: str,
                      repair: Callable[[], None]) -> list[int]:
    """Run ``repair`` once, just before the first rename of ``path``."""
    fired: list[int] = []
    real = os.rename

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if not fired and os.fspath(src) == path:
            fired.append(1)
            repair()
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    return fired


@pytest.mark.parametrize("bad", ["torn file", "symlink"])
def test_a_stale_quarantine_never_moves_a_repaired_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    good = b"good kernel" * 100
    sha = _sha(good)
    reader, publisher = ArtifactPool(tmp_path / "pool"), ArtifactPool(tmp_path / "pool")
    path = reader.layout.object_path(sha)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if bad == "torn file":
        Path(path).write_bytes(good[:-5])
    else:
        (tmp_path / "elsewhere").write_bytes(good)
        os.symlink(tmp_path / "elsewhere", path)
    fired = _repair_at_rename(monkeypatch, path, lambda: publisher.put(good))
    assert reader.get(sha) is None  # what it found was bad
    assert fired == [1]
    assert os.path.isfile(path) and not os.path.islink(path)
    assert Path(path).read_bytes() == good
    assert publisher.get(sha) == good
    assert (reader.quarantined, publisher.quarantined) == (0, 1)
    assert len(os.listdir(reader.layout.quarantine)) == 1


def test_a_file_moved_aside_by_mistake_is_dropped_when_another_took_its_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "object"
    path.write_bytes(b"first repair")
    judged = tmp_path / "judged bad"
    judged.write_bytes(b"bad")
    st = os.lstat(judged)
    real = os.link

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(dst) == str(path):
            path.write_bytes(b"second repair")  # published while it was away
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    assert _fs.move_aside(str(path), tmp_path / "dest", st) is False
    assert path.read_bytes() == b"second repair"
    assert not (tmp_path / "dest").exists()


def test_move_aside_moves_the_file_judged_bad(tmp_path: Path) -> None:
    path = tmp_path / "object"
    path.write_bytes(b"bad")
    assert _fs.move_aside(str(path), tmp_path / "dest", os.lstat(path)) is True
    assert not path.exists() and (tmp_path / "dest").read_bytes() == b"bad"
    assert _fs.move_aside(str(path), tmp_path / "dest2", None) is False  # gone


# --- 4: an export built inside its directory, interrupted or killed ---------------------

A, B = b"A" * 50, b"B" * 60
ART_A, ART_B = Artifact("x/a.cubin", _sha(A)), Artifact("x/b.cubin", _sha(B))


@pytest.fixture
def export_pool(tmp_path: Path) -> ArtifactPool:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(A)
    pool.put(B)
    return pool


def _inside(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    """``out`` as a mount point: the export is built inside it."""
    real = os.path.ismount
    monkeypatch.setattr(_mirror.os.path, "ismount", lambda p: Path(p) == out or real(p))


def _listed(out: Path) -> dict[str, str]:
    return {a.name: a.sha256 for a in parse_checksums((out / "checksums.txt").read_text())}


@pytest.mark.parametrize("earlier", [True, False])
def test_an_interrupted_export_inside_its_directory_completes_when_run_again(
        tmp_path: Path, export_pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch,
        earlier: bool) -> None:
    out = tmp_path / "usb"
    if earlier:
        export_directory(export_pool, [ART_A], out)
    else:
        out.mkdir()
    _inside(monkeypatch, out)
    real = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(dst).endswith("/checksums.txt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)
        real(src, dst, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)
        with pytest.raises(PoolError, match="export the same artifacts again"):
            export_directory(export_pool, [ART_A, ART_B], out)
    assert (out / "x" / "b.cubin").read_bytes() == B  # part-way
    export_directory(export_pool, [ART_A, ART_B], out)
    assert _listed(out) == {"x/a.cubin": _sha(A), "x/b.cubin": _sha(B)}
    assert (out / "x" / "b.cubin").read_bytes() == B
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_a_leftover_file_with_other_bytes_is_still_refused(
        tmp_path: Path, export_pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "usb"
    export_directory(export_pool, [ART_A], out)
    _inside(monkeypatch, out)
    (out / "x" / "b.cubin").write_bytes(b"someone else's")
    with pytest.raises(PoolError, match=r"holds x/b\.cubin"):
        export_directory(export_pool, [ART_A, ART_B], out)
    assert (out / "x" / "b.cubin").read_bytes() == b"someone else's"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_export_inside_its_directory_leaves_nothing_that_blocks_the_next(
        tmp_path: Path, export_pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "usb"
    export_directory(export_pool, [ART_A], out)
    _inside(monkeypatch, out)
    left = out / f".distcache-export.{_mirror._HOST}.{_dead_pid()}.{'ab' * 6}.new"
    (left / "x").mkdir(parents=True)
    (left / "x" / "b.cubin").write_bytes(B[:10])
    export_directory(export_pool, [ART_A, ART_B], out)
    assert not left.exists()
    assert _listed(out) == {"x/a.cubin": _sha(A), "x/b.cubin": _sha(B)}
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("whose", ["live process", "other host", "no host named"])
def test_an_export_being_built_inside_is_left_alone_and_named(
        tmp_path: Path, export_pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch,
        whose: str) -> None:
    out = tmp_path / "usb"
    export_directory(export_pool, [ART_A], out)
    _inside(monkeypatch, out)
    host = {"other host": "elsewhere.", "live process": f"{_mirror._HOST}.",
            "no host named": ""}[whose]
    pid = os.getpid() if whose == "live process" else _dead_pid()
    building = out / f".distcache-export.{host}{pid}.{'cd' * 6}.new"
    building.mkdir()
    with pytest.raises(PoolError) as refused:
        export_directory(export_pool, [ART_A, ART_B], out)
    assert f"remove {building} if no export runs there" in str(refused.value)
    assert building.is_dir()
    assert _listed(out) == {"x/a.cubin": _sha(A)}


def test_an_uncapped_pool_keeps_no_record_of_a_batchs_hits(tmp_path: Path) -> None:
    # The record of what an open batch found is for the cap's collection at its end;
    # with no cap there is none, and a batch of many lookups holds nothing per hit.
    data = [_bytes(100 + i) for i in range(5)]
    uncapped, capped = ArtifactPool(tmp_path / "a"), ArtifactPool(tmp_path / "b", max_bytes=10**6)
    for pool in (uncapped, capped):
        for blob in data:
            pool.put(blob)
    artifacts = [Artifact(f"k{i}.cubin", _sha(blob)) for i, blob in enumerate(data)]
    for pool, kept in ((uncapped, 0), (capped, 5)):
        with pool.batch():
            assert [pool.fetch(a, None) for a in artifacts] == data
            assert len(pool._cap._fresh) == kept
