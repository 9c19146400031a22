"""Constructing :class:`Downloads` starts nothing; :meth:`Downloads.start` starts its
workers, once, so that a caller starts them inside the pool batch they belong to."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective._download import Downloads
from distcache.origins._directory import DirOrigin
from distcache.store import ArtifactPool
from tests.unit.test_pool_cap_and_hygiene_truth import DAY, A, B, Z
from tests.unit.test_pool_cap_and_hygiene_truth import _origin as _origin_dir


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("distcache-fetch-")]


def _origin(tmp_path: Path) -> DirOrigin:
    """The origin of test_pool_cap_and_hygiene_truth (a.bin = A, b.bin = B)."""
    return DirOrigin(str(_origin_dir(tmp_path)))


def _artifacts() -> list[Artifact]:
    return [Artifact("a.bin", sha256_hex(A), 1000), Artifact("b.bin", sha256_hex(B), 1000)]


def _wait_for_no_workers() -> None:
    until = time.monotonic() + 10
    while _workers() and time.monotonic() < until:
        time.sleep(0.01)
    assert not _workers()


def test_constructing_downloads_starts_no_thread(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool", max_bytes=None)
    _wait_for_no_workers()
    before = threading.active_count()
    downloads = Downloads(pool, _origin(tmp_path), _artifacts(), workers=2)
    time.sleep(0.2)
    assert threading.active_count() == before and not _workers()
    assert not downloads.wait(0.05) and not pool.has(sha256_hex(A))
    downloads.start()
    assert downloads.wait(10)
    got = downloads.result()
    assert got.failure is None and got.downloads == 2
    assert pool.has(sha256_hex(A)) and pool.has(sha256_hex(B))


def test_starting_downloads_twice_raises(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool", max_bytes=None)
    origin = _origin(tmp_path)
    downloads = Downloads(pool, origin, _artifacts(), workers=1)
    assert downloads.start() is downloads
    with pytest.raises(RuntimeError, match="started already"):
        downloads.start()
    assert downloads.wait(10) and downloads.result().downloads == 2
    empty = Downloads(pool, origin, [], workers=1).start()
    assert empty.wait(0) and empty.result().downloads == 0
    with pytest.raises(RuntimeError, match="started already"):
        empty.start()


def test_downloads_made_before_the_batch_but_started_in_it_hold_what_they_find(
        tmp_path: Path) -> None:
    # A is present and the oldest object: held by the batch it is found in, the capped
    # collection when the batch ends keeps it and removes Z instead.
    pool = ArtifactPool(tmp_path / "pool", max_bytes=None)
    for data, age in ((A, 10 * DAY), (Z, 5 * DAY)):
        sha = pool.put(data)
        when = time.time() - age
        os.utime(pool.layout.object_path(sha), (when, when))
    pool.max_bytes = 2500
    downloads = Downloads(pool, _origin(tmp_path), _artifacts(), workers=1)
    time.sleep(0.2)  # a worker started now would find A before any batch is open
    with pool.batch():
        downloads.start()
        assert downloads.wait(10)
    got = downloads.result()
    assert got.failure is None and (got.downloads, got.placed) == (1, 1)
    assert pool.has(sha256_hex(A)) and pool.has(sha256_hex(B))
    assert not pool.has(sha256_hex(Z))
