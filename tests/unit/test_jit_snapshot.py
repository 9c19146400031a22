"""What a rank built during the run, told by ``stat`` alone: a file rewritten with
other bytes of the same size is published (at ``Session.sync`` and at the engine
hook's exit), and a file that was only read is neither read again nor republished."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from distcache import jit
from distcache.artifact import sha256_hex
from distcache.comm import local
from distcache.integrations import _compile_caches
from distcache.jit import _place
from distcache.session import SessionSlot
from distcache.store import ArtifactPool

OLD = b"kernel v1" * 50
NEW = b"kernel v2" * 50  # the same length, other bytes
# How a tool rewrites a file: in place or by renaming a new file over it, keeping
# the old times or not (the inode change time moves either way).
REWRITES = [("in place", True), ("replaced", True), ("in place", False)]


def rewrite(path: Path, data: bytes, *, how: str, keep_times: bool) -> None:
    """Give ``path`` the bytes ``data`` (of its length). Where the filesystem's clock
    has not moved since the last ``stat`` the change time would not either: write
    again until it has."""
    old = os.stat(path)
    assert len(data) == old.st_size
    for _ in range(1000):
        if how == "in place":
            with open(path, "r+b") as out:
                out.write(data)
        else:
            staged = path.with_name(f".{path.name}.new")
            staged.write_bytes(data)
            os.replace(staged, path)
        if keep_times:
            os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
        if os.stat(path).st_ctime_ns != old.st_ctime_ns:
            break
        time.sleep(0.001)
    now = os.stat(path)
    assert now.st_size == old.st_size and path.read_bytes() == data
    assert not keep_times or now.st_mtime_ns == old.st_mtime_ns


def inductor(root: Path, pool: ArtifactPool) -> jit.Family:
    return jit.Family(jit.FamilySpec("inductor", "tool=1;linux", (jit.Root(root),)), pool)


def served(pool: ArtifactPool, name: str, key: str, path: str) -> str:
    return jit.union(jit.read_trees(pool, name, key)).entries[path].sha256


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads: list[int] = []
    real = _place._read_all

    def counted(fd: int, size: int) -> tuple[str, int]:
        reads.append(size)
        return real(fd, size)

    monkeypatch.setattr(_place, "_read_all", counted)
    return reads


@pytest.mark.parametrize(("how", "keep_times"), REWRITES)
def test_a_second_publish_stores_a_same_size_rewrite(tmp_path: Path, how: str,
                                                     keep_times: bool) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    built.mkdir()
    (built / "k.so").write_bytes(OLD)
    (built / "other.so").write_bytes(b"untouched")
    family = inductor(built, pool)
    assert family.publish() == 2
    rewrite(built / "k.so", NEW, how=how, keep_times=keep_times)
    assert family.publish() == 1 and family.report.published == 1
    assert served(pool, "inductor", family.key, "k.so") == sha256_hex(NEW)
    assert family.publish() == 0


def test_a_file_only_read_is_neither_read_again_nor_republished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    built.mkdir()
    (built / "k.so").write_bytes(OLD)
    # As if written long before the scan (a change time cannot be set back).
    monkeypatch.setattr(_place, "settled", lambda st: True)
    family = inductor(built, pool)
    assert family.publish() == 1
    reads = count_reads(monkeypatch)
    assert (built / "k.so").read_bytes() == OLD  # a compile loading it
    assert family.publish() == 0 and reads == []
    assert len(jit.read_trees(pool, "inductor", family.key)) == 1


def test_a_file_written_just_before_a_scan_is_read_again_at_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its times may not move if it is rewritten within the same tick of the
    # filesystem's clock, so its record is not trusted: hashed again, not published.
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    built.mkdir()
    (built / "k.so").write_bytes(OLD)
    family = inductor(built, pool)
    assert family.publish() == 1
    reads = count_reads(monkeypatch)
    assert family.publish() == 0 and reads == [len(OLD)]


@pytest.mark.parametrize(("how", "keep_times"), REWRITES)
def test_sync_publishes_a_same_size_rewrite(tmp_path: Path, how: str, keep_times: bool) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTCACHE_", "TORCHINDUCTOR_", "TRITON_"))}
    env.update(DISTCACHE_POOL=str(tmp_path / "pool"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TMPDIR=str(tmp_path))
    built = tmp_path / "inductor" / "ab"
    with SessionSlot().init(comm=local(), integrations=(), jit_caches=["inductor"],
                            environ=env) as session:
        (family,) = [i for i in session.integrations if isinstance(i, jit.Family)]
        built.mkdir(parents=True)
        (built / "k.so").write_bytes(OLD)
        session.sync()
        assert family.report.published == 1
        rewrite(built / "k.so", NEW, how=how, keep_times=keep_times)
        session.sync()
        assert family.report.published == 1
        session.sync()
        assert family.report.published == 0
    key = jit.family("inductor", environ=env).key
    assert served(ArtifactPool(tmp_path / "pool"), "inductor", key, "ab/k.so") == sha256_hex(NEW)


def _armed(tmp: Path) -> tuple[list[jit.Family], dict[str, Any]]:
    """The vLLM family filled from the pool, and the snapshot the hook takes then."""
    chosen = jit.families(["vllm"], pool=ArtifactPool(tmp / "pool"),
                          environ={"VLLM_CACHE_ROOT": str(tmp / "vllm")})
    chosen[0].materialize()
    return chosen, {"vllm": _compile_caches.armed_snapshot(chosen[0])}


def _seed(tmp: Path) -> Path:
    """A model and a kernel this host built and published at an earlier launch;
    the model's path."""
    cache = tmp / "vllm" / "torch_compile_cache"
    for rel, data in (("h/rank_0_0/model", OLD), ("h/inductor_cache/k.py", b"source")):
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    jit.family("vllm", pool=ArtifactPool(tmp / "pool"),
               environ={"VLLM_CACHE_ROOT": str(tmp / "vllm")}).publish()
    return cache / "h" / "rank_0_0" / "model"


@pytest.mark.parametrize(("how", "keep_times"), REWRITES)
def test_the_exit_publishes_a_same_size_rewrite(tmp_path: Path, how: str,
                                                keep_times: bool) -> None:
    model = _seed(tmp_path)
    chosen, armed = _armed(tmp_path)
    assert armed["vllm"] is not None and model.read_bytes() == OLD
    rewrite(model, NEW, how=how, keep_times=keep_times)
    (row,) = _compile_caches.publish_at_exit(chosen, "test", "main", os.getpid(), armed)
    assert row["files"] == 1 and "unchanged" not in row
    pool = ArtifactPool(tmp_path / "pool")
    assert served(pool, "vllm", chosen[0].key, "h/rank_0_0/model") == sha256_hex(NEW)


def test_the_exit_leaves_files_only_read_unpublished(tmp_path: Path) -> None:
    model = _seed(tmp_path)
    chosen, armed = _armed(tmp_path)
    assert model.read_bytes() == OLD  # a compile loading it
    (row,) = _compile_caches.publish_at_exit(chosen, "test", "main", os.getpid(), armed)
    assert row == {"name": "vllm", "files": 0, "unchanged": True, "seconds": row["seconds"]}
    assert len(jit.read_trees(ArtifactPool(tmp_path / "pool"), "vllm", chosen[0].key)) == 1
