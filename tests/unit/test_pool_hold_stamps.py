"""Holding objects a start-up found present: one lstat each when their stamps are
recent, a stale stamp written through a descriptor of the object itself (a file
swapped in at its name meanwhile is never vouched for), and an object whose stamp
this user may not write tried once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from distcache.store import ArtifactPool, _objects


@pytest.fixture
def pool(tmp_path: Path) -> ArtifactPool:
    return ArtifactPool(tmp_path / "pool")


def _age(pool: ArtifactPool, sha: str, seconds: float = 3600) -> None:
    path = pool.layout.object_path(sha)
    old = os.stat(path).st_mtime - seconds
    os.utime(path, (old, old))


def _opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    real = _objects.open_object

    def counting(fanout: str, name: str, path: str) -> Any:
        opened.append(name)
        return real(fanout, name, path)

    monkeypatch.setattr(_objects, "open_object", counting)
    return opened


def test_recent_stamps_cost_no_open(pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch
                                    ) -> None:
    shas = [pool.put(bytes([i]) * 100) for i in range(20)]
    opened = _opens(monkeypatch)
    pool.hold(shas)
    assert opened == []


def test_a_stale_stamp_is_refreshed_through_the_object_itself(
        pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch) -> None:
    sha = pool.put(b"x" * 100)
    _age(pool, sha)
    opened = _opens(monkeypatch)
    pool.hold([sha])
    assert opened == [sha]
    assert os.stat(pool.layout.object_path(sha)).st_mtime > os.path.getmtime(
        pool.layout.root) - 60


def test_a_file_swapped_in_while_stamping_is_not_vouched_for(
        pool: ArtifactPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"good" * 1000
    sha = pool.put(data)
    pool._store.stamp_interval = 0.0  # every stamp is stale: each hold writes one
    assert pool.get(sha, trust_own=True) == data  # verified in this process
    path = pool.layout.object_path(sha)
    bad = tmp_path / "bad"
    bad.write_bytes(b"EVIL" * 1000)  # the same size
    real = os.utime

    def swapping(*args: Any, **kwargs: Any) -> None:
        os.rename(bad, path)  # another process replaces the object as it is stamped
        real(*args, **kwargs)

    monkeypatch.setattr(_objects.os, "utime", swapping)
    pool.hold([sha])
    monkeypatch.undo()
    assert pool.get(sha, trust_own=True) is None  # hashed, found wrong: a miss
    assert pool.quarantined == 1


def test_a_stamp_this_user_may_not_write_is_tried_once(
        pool: ArtifactPool, monkeypatch: pytest.MonkeyPatch) -> None:
    sha = pool.put(b"y" * 100)
    _age(pool, sha)
    tried: list[object] = []

    def refused(*args: Any, **kwargs: Any) -> None:
        tried.append(args)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(_objects.os, "utime", refused)
    for _ in range(3):
        pool.hold([sha])  # never raised
    assert len(tried) == 1
    assert pool.has(sha)
