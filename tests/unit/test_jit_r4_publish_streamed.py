"""Publishing a JIT cache streams each file: it is hashed and stored a piece at a
time, never held whole in memory (a compiled artifact may run to gigabytes)."""

from __future__ import annotations

import errno
import hashlib
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from distcache.jit import Family, FamilySpec, Root
from distcache.jit._tree import read_trees
from distcache.store import ArtifactPool

KEY = "tool=1;py=3.11;linux"
SIZE = 16 << 20
#: Peak traced memory of one publication, as a multiple of the largest file's size.
BOUND = 0.5


@pytest.fixture(autouse=True)
def _staged_above_one_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    # Files above the threshold go through the staged copy; 16 MiB stands for gigabytes.
    monkeypatch.setattr("distcache.jit._stream.SMALL", 1 << 20)


@pytest.fixture(scope="module")
def big() -> bytes:
    return os.urandom(SIZE)


def _cache_with(tmp_path: Path, files: dict[str, bytes]) -> Path:
    cache = tmp_path / "cache"
    for rel, data in files.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
        os.utime(cache / rel, (1_000_000, 1_000_000))  # long settled
    return cache


def _publish_peak(family: Family) -> tuple[int, float]:
    tracemalloc.start()
    try:
        count = family.publish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return count, peak / SIZE


def test_a_large_file_is_published_without_being_held_whole(tmp_path: Path, big: bytes) -> None:
    cache = _cache_with(tmp_path, {"k/big.so": big, "k/small.json": b"{}", "k/empty": b""})
    pool = ArtifactPool(tmp_path / "pool")
    family = Family(FamilySpec("tool", KEY, (Root(cache),)), pool)
    count, peak = _publish_peak(family)
    assert count == 3
    assert peak < BOUND, f"publishing held {peak:.2f} times the largest file"
    (tree,) = read_trees(pool, "tool", KEY)
    listed = {e.path: (e.sha256, e.size) for e in tree.entries}
    assert listed == {"k/big.so": (hashlib.sha256(big).hexdigest(), SIZE),
                      "k/small.json": (hashlib.sha256(b"{}").hexdigest(), 2),
                      "k/empty": (hashlib.sha256(b"").hexdigest(), 0)}
    assert pool.get(hashlib.sha256(big).hexdigest()) == big
    assert pool.get(hashlib.sha256(b"").hexdigest()) == b""
    assert os.listdir(pool.layout.tmp) == []  # nothing staged is left behind


def test_a_second_process_hashes_a_published_file_in_pieces(tmp_path: Path, big: bytes) -> None:
    cache = _cache_with(tmp_path, {"k/big.so": big})
    pool = ArtifactPool(tmp_path / "pool")
    assert Family(FamilySpec("tool", KEY, (Root(cache),)), pool).publish() == 1
    # Another family object (a later launch): reads the file again, finds it stored.
    count, peak = _publish_peak(Family(FamilySpec("tool", KEY, (Root(cache),)), pool))
    assert count == 0
    assert peak < BOUND, f"hashing a stored file held {peak:.2f} times its size"


def test_a_full_disk_while_staging_fails_the_publish_naming_the_pool(
        tmp_path: Path, big: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.errors import PoolError
    from distcache.jit import _stream

    cache = _cache_with(tmp_path, {"k/big.so": big})
    pool = ArtifactPool(tmp_path / "pool")
    real = _stream._staging

    class Full:
        """The staged copy on a filesystem that has no room left."""

        def __init__(self, staged: Any) -> None:
            self._staged = staged

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc_info: object) -> None:
            self._staged.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._staged, name)

    monkeypatch.setattr(_stream, "_staging", lambda p: Full(real(p)))
    with pytest.raises(PoolError, match="No space left on device") as failed:
        Family(FamilySpec("tool", KEY, (Root(cache),)), pool).publish()
    assert str(pool.root) in str(failed.value)
    assert read_trees(pool, "tool", KEY) == []
