"""How much memory the loader wrapper holds for one large artifact.

FlashInfer's cute-dsl ``.so`` files and fused-MoE cubins run to hundreds of megabytes,
and several ranks of a node load them at once: a call must not hold the artifact twice
(what it returns is one copy; a second one, kept for a failure that did not happen, or
a file read whole just to compare it, doubles the peak). Python's allocations are
traced; the bound is one and a half times the artifact.
"""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.errors import PoolError
from distcache.integrations.flashinfer._loader import PooledLoader
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool

SIZE = 16 << 20
#: Peak traced memory of one call, as a multiple of the artifact's size.
BOUND = 1.5
CUBIN_NAME = "pin/fmha/trtllm-gen/big.cubin"
SO_NAME = "pin/fmha/cute-dsl/x86_64/sm_100a/big.so"  # also written into the cubin dir
OTHER_NAME = "pin/other/big.bin"  # not pooled: FlashInfer's function answers


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def peak_of(call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()``'s answer and the peak memory it allocated, in artifact sizes."""
    tracemalloc.start()
    try:
        answer = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return answer, peak / SIZE


@pytest.fixture(scope="module")
def big() -> bytes:
    return os.urandom(SIZE)


def mirror_of(tmp_path: Path, name: str, data: bytes) -> Path:
    mirror = tmp_path / "mirror"
    (mirror / name).parent.mkdir(parents=True)
    (mirror / name).write_bytes(data)
    return mirror


class FetchOnly:
    """An origin with ``fetch`` alone (no ``fetch_into``), reading a mirror."""

    def __init__(self, mirror: Path) -> None:
        self.mirror = mirror
        self.calls = 0

    def describe(self) -> str:
        return f"test://{self.mirror}"

    def fetch(self, artifact: Artifact) -> bytes:
        self.calls += 1
        return (self.mirror / artifact.name).read_bytes()


@pytest.mark.parametrize("streamed", [True, False], ids=["fetch_into", "fetch"])
def test_a_download_is_held_once(tmp_path: Path, big: bytes, streamed: bool) -> None:
    mirror = mirror_of(tmp_path, CUBIN_NAME, big)
    origin = DirOrigin(mirror) if streamed else FetchOnly(mirror)
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), lambda *a: b"",
                          origin=origin)  # type: ignore[arg-type]
    answer, peak = peak_of(lambda: loader(CUBIN_NAME, sha(big)))
    assert answer == big and loader.stats.fetched == 1
    assert peak < BOUND, f"one download held {peak:.2f} times the artifact's size"


def test_a_download_the_pool_cannot_publish_is_served_without_a_second_download(
    tmp_path: Path, big: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = FetchOnly(mirror_of(tmp_path, CUBIN_NAME, big))
    pool = ArtifactPool(tmp_path / "pool")

    def refuse(*args: Any, **kwargs: Any) -> bool:
        raise PoolError("cannot publish: No space left on device", path="objects")

    monkeypatch.setattr(pool._store, "publish", refuse)
    loader = PooledLoader(pool, lambda *a: b"", origin=origin)  # type: ignore[arg-type]
    answer, peak = peak_of(lambda: loader(CUBIN_NAME, sha(big)))
    assert answer == big and origin.calls == 1
    assert (loader.stats.fetched, loader.stats.unpublished) == (1, 1)
    assert peak < BOUND, f"an unpublished download held {peak:.2f} times its size"
    assert not pool.has(sha(big))


def test_a_pool_hit_already_placed_is_not_read_whole_again(tmp_path: Path, big: bytes) -> None:
    pool, cubins = ArtifactPool(tmp_path / "pool"), tmp_path / "cubins"
    pool.put(big, sha(big))
    loader = PooledLoader(pool, lambda *a: b"", cubin_dir=lambda: cubins)
    assert loader(SO_NAME, sha(big)) == big  # placed into the cubin directory
    placed = cubins / SO_NAME
    inode = placed.stat().st_ino
    answer, peak = peak_of(lambda: loader(SO_NAME, sha(big)))
    assert answer == big and placed.stat().st_ino == inode  # left in place
    assert peak < BOUND, f"a pool hit held {peak:.2f} times the artifact's size"


def test_an_installed_file_kept_in_the_cubin_directory_is_compared_without_a_copy(
    tmp_path: Path, big: bytes
) -> None:
    installed, cubins = tmp_path / "installed", tmp_path / "cubins"
    for root, data in ((installed, big), (cubins, big[:-1] + b"\0")):  # an older file there
        (root / OTHER_NAME).parent.mkdir(parents=True)
        (root / OTHER_NAME).write_bytes(data)
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), lambda *a: b"",
                          cubin_dir=lambda: cubins, seed_dirs=lambda: (installed,))
    answer, peak = peak_of(lambda: loader(OTHER_NAME, sha(big)))
    assert answer == big and (cubins / OTHER_NAME).read_bytes() == big
    assert peak < BOUND, f"keeping an installed file held {peak:.2f} times its size"
    inode = (cubins / OTHER_NAME).stat().st_ino
    answer, peak = peak_of(lambda: loader(OTHER_NAME, sha(big)))
    assert answer == big and (cubins / OTHER_NAME).stat().st_ino == inode
    assert peak < BOUND, f"an installed file already kept held {peak:.2f} times its size"
