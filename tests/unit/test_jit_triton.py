"""The Triton cache manager over the pool, through Triton's own cache API:
``triton.runtime.cache.get_cache_manager`` with ``TRITON_CACHE_MANAGER`` set (no GPU
is needed to put and get groups)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from distcache import jit
from distcache.store import ArtifactPool

cache = pytest.importorskip("triton.runtime.cache")

MANAGER = "distcache.jit._triton:PoolCacheManager"
CUBIN = b"\x7fELF cubin of the kernel" + bytes(range(256)) * 8
META = {"name": "add_kernel", "num_warps": 4, "shared": 0}


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("TRITON_CACHE_MANAGER", MANAGER)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("DISTCACHE_POOL", str(tmp_path / "pool"))
    return tmp_path / "triton", tmp_path / "pool"


def key_of(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def put_kernel(key: str) -> dict[str, str]:
    manager = cache.get_cache_manager(key)
    assert type(manager).__name__ == "PoolCacheManager"
    paths = {"add_kernel.cubin": manager.put(CUBIN, "add_kernel.cubin"),
             "add_kernel.json": manager.put(json.dumps(META), "add_kernel.json", binary=False)}
    manager.put_group("add_kernel.json", paths)
    return paths


def test_a_group_put_on_one_node_is_served_to_an_empty_cache(where: tuple[Path, Path]) -> None:
    directory, pool_dir = where
    key = key_of("round trip")
    put_kernel(key)
    shutil.rmtree(directory)  # a fresh node: same path, nothing in it
    group = cache.get_cache_manager(key).get_group("add_kernel.json")
    assert group is not None and sorted(group) == ["add_kernel.cubin", "add_kernel.json"]
    assert Path(group["add_kernel.cubin"]).read_bytes() == CUBIN
    assert json.loads(Path(group["add_kernel.json"]).read_text()) == META
    assert cache.get_cache_manager(key).get_file("add_kernel.cubin") == group["add_kernel.cubin"]
    # An unknown kernel is a miss, as with Triton's own manager.
    assert cache.get_cache_manager(key_of("other")).get_group("add_kernel.json") is None
    # The directory family sees the same trees (one key, Triton's layout).
    family = jit.family("triton", pool=ArtifactPool(pool_dir))
    (tree,) = jit.read_trees(family.pool, "triton", family.key)
    assert len(tree.entries) == 3


_WRITER = """
import hashlib, json, sys
from triton.runtime.cache import get_cache_manager
key = hashlib.sha256(b"two writers").hexdigest()
m = get_cache_manager(key)
paths = {"add_kernel.cubin": m.put(bytes.fromhex(sys.argv[1]), "add_kernel.cubin"),
         "add_kernel.json": m.put(sys.argv[2], "add_kernel.json", binary=False)}
m.put_group("add_kernel.json", paths)
"""


def test_two_processes_writing_one_key(where: tuple[Path, Path]) -> None:
    directory, pool_dir = where
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, CUBIN.hex(), json.dumps(META)],
                                env=env) for _ in range(2)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    family = jit.family("triton", pool=ArtifactPool(pool_dir))
    trees = jit.read_trees(family.pool, "triton", family.key)
    merged = jit.union(trees)
    # Equal bytes from both writers: one tree object, no conflict.
    assert len(trees) == 1 and merged.conflicts == {}
    shutil.rmtree(directory)
    group = cache.get_cache_manager(key_of("two writers")).get_group("add_kernel.json")
    assert group is not None and Path(group["add_kernel.cubin"]).read_bytes() == CUBIN


def test_a_corrupted_object_is_refused(where: tuple[Path, Path]) -> None:
    directory, pool_dir = where
    key = key_of("corrupt")
    put_kernel(key)
    pool = ArtifactPool(pool_dir)
    family = jit.family("triton", pool=pool)
    (tree,) = jit.read_trees(pool, "triton", family.key)
    sha = next(e.sha256 for e in tree.entries if e.path.endswith(".cubin"))
    obj = Path(pool.layout.object_path(sha))
    obj.chmod(0o644)
    obj.write_bytes(CUBIN[::-1])
    shutil.rmtree(directory)
    manager = cache.get_cache_manager(key)
    assert manager.get_group("add_kernel.json") is None
    assert manager.get_file("add_kernel.cubin") is None
    assert not list(directory.rglob("*.cubin"))
    assert list((pool_dir / "quarantine").iterdir()), "the bad object was not quarantined"
