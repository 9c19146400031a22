"""A publication into a capped pool (``max_bytes``) keeps its files and the tree that
lists them together: the collection it triggers runs once all are stored, around all
of them, so a tree never names files its own publication collected."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from distcache import jit
from distcache.jit import _place
from distcache.store import ArtifactPool

SIZE = 600
FILES = {f"k{i}/kernel.so": bytes([i]) * SIZE for i in range(3)}


def build(root: Path) -> None:
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


@pytest.mark.parametrize("racy_ns", [0, _place.RACY_NS], ids=["settled", "just-built"])
def test_a_publication_over_the_cap_keeps_every_file_its_tree_lists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, racy_ns: int) -> None:
    # settled: stored as scanned; just-built: stored after the settling wait.
    monkeypatch.setattr(_place, "RACY_NS", racy_ns)
    src, dst = tmp_path / "src", tmp_path / "dst"
    build(src)
    pool = ArtifactPool(tmp_path / "pool", max_bytes=1500)  # less than the 3 files
    assert jit.Family(jit.FamilySpec("inductor", "K", (jit.Root(src),)), pool).publish() == 3
    assert len(list(pool.objects())) == 4  # the 3 files and their tree, over the cap
    placed = jit.Family(jit.FamilySpec("inductor", "K", (jit.Root(dst),)), pool).materialize()
    assert (placed.written, placed.missing) == (3, 0)
    for rel, data in FILES.items():
        assert (dst / rel).read_bytes() == data


def test_a_group_triton_puts_into_a_capped_pool_is_served_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = pytest.importorskip("triton.runtime.cache")
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "distcache.jit._triton:PoolCacheManager")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("DISTCACHE_POOL", str(tmp_path / "pool"))
    monkeypatch.setenv("DISTCACHE_POOL_MAX_BYTES", "1500")
    monkeypatch.delenv("DISTCACHE_DISABLE", raising=False)
    key = hashlib.sha256(b"capped pool").hexdigest()
    manager = cache.get_cache_manager(key)
    paths = {f"k{i}.cubin": manager.put(bytes([i]) * SIZE, f"k{i}.cubin") for i in range(3)}
    manager.put_group("k.json", paths)
    # The 3 files, the group file and the tree: kept whole, over the cap.
    assert len(list(ArtifactPool(tmp_path / "pool").objects())) == 5
    shutil.rmtree(tmp_path / "triton")  # a fresh node: filled from the pool
    group = cache.get_cache_manager(key).get_group("k.json")
    assert group is not None and sorted(group) == sorted(paths)
    for i in range(3):
        assert Path(group[f"k{i}.cubin"]).read_bytes() == bytes([i]) * SIZE
