"""A JIT cache directory of this user's that every user may write to (no sticky
bit) is refused, as one on the way to it is: another local user could plant
compiled code there that the engine would load, or that the pool would spread."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from distcache import jit
from distcache.errors import JitCacheError
from distcache.jit import Family, FamilySpec, Root
from distcache.jit._tree import TreeEntry, TreeManifest, publish_tree, read_trees
from distcache.store import ArtifactPool

KEY = "tool=1;py=3.11;linux"


def _family(pool: ArtifactPool, directory: Path) -> Family:
    return Family(FamilySpec("tool", KEY, (Root(directory),)), pool)


def _serve(pool: ArtifactPool, files: dict[str, bytes]) -> None:
    entries = tuple(TreeEntry(rel, pool.put(data), 0o644, len(data))
                    for rel, data in files.items())
    publish_tree(pool, TreeManifest("tool", KEY, entries))


def _open_to_all(directory: Path, mode: int = 0o777) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, mode)


def test_materialising_into_a_world_writable_cache_directory_is_refused(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    _serve(pool, {"k/a.so": b"\x7fELF a"})
    cache = tmp_path / "cache"
    _open_to_all(cache)
    with pytest.raises(JitCacheError) as caught:
        _family(pool, cache).materialize()
    message = str(caught.value)
    assert str(cache) in message and "0o777" in message
    assert f"uid {os.geteuid()}" in message and f"chmod go-w {cache}" in message
    assert not (cache / "k").exists()


def test_publishing_from_a_world_writable_cache_directory_is_refused(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    cache = tmp_path / "cache"
    (cache / "k").mkdir(parents=True)
    (cache / "k" / "a.so").write_bytes(b"\x7fELF planted")
    os.utime(cache / "k" / "a.so", (1, 1))  # long settled
    os.chmod(cache, 0o777)
    with pytest.raises(JitCacheError, match="chmod go-w"):
        _family(pool, cache).publish()
    assert read_trees(pool, "tool", KEY) == []


def test_a_world_writable_directory_with_the_sticky_bit_is_used(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    _serve(pool, {"k/a.so": b"\x7fELF a"})
    cache = tmp_path / "cache"
    _open_to_all(cache, 0o1777)
    assert _family(pool, cache).materialize().written == 1
    assert (cache / "k" / "a.so").read_bytes() == b"\x7fELF a"


def test_a_world_writable_subdirectory_leaves_only_its_entries_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    _serve(pool, {"open/a.so": b"\x7fELF a", "closed/b.so": b"\x7fELF b"})
    cache = tmp_path / "cache"
    cache.mkdir()
    _open_to_all(cache / "open")
    with caplog.at_level(logging.WARNING):
        placed = _family(pool, cache).materialize()
    assert (placed.written, placed.kept) == (1, 1)
    assert (cache / "closed" / "b.so").exists() and not (cache / "open" / "a.so").exists()
    assert f"chmod go-w {cache / 'open'}" in caplog.text


def test_the_other_families_are_still_filled(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    environ = {"DG_JIT_CACHE_DIR": str(tmp_path / "dg"),
               "TRITON_CACHE_DIR": str(tmp_path / "triton"), "HOME": str(tmp_path)}
    chosen = jit.families(["deep_gemm", "triton"], pool=pool, environ=environ)
    for fam in chosen:
        entries = (TreeEntry("k/a.so", pool.put(fam.name.encode()), 0o644, len(fam.name)),)
        publish_tree(pool, TreeManifest(fam.name, fam.key, entries))
    _open_to_all(tmp_path / "dg")
    with pytest.raises(JitCacheError, match=r"deep_gemm: .*0o777"):
        jit.materialize(chosen)
    assert (tmp_path / "triton" / "k" / "a.so").read_bytes() == b"triton"
    assert not (tmp_path / "dg" / "k").exists()


def test_triton_publishes_nothing_from_a_world_writable_cache_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    cache = pytest.importorskip("triton.runtime.cache")
    directory, pool_dir = tmp_path / "triton", tmp_path / "pool"
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "distcache.jit._triton:PoolCacheManager")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(directory))
    monkeypatch.setenv("DISTCACHE_POOL", str(pool_dir))
    _open_to_all(directory)
    manager = cache.get_cache_manager("a" * 64)
    assert type(manager).__name__ == "PoolCacheManager"
    paths = {"k.cubin": manager.put(b"\x7fELF planted?", "k.cubin")}
    with caplog.at_level(logging.WARNING):
        manager.put_group("k.json", paths)
    assert f"chmod go-w {directory}" in caplog.text
    family = jit.family("triton", pool=ArtifactPool(pool_dir))
    assert jit.read_trees(family.pool, "triton", family.key) == []
