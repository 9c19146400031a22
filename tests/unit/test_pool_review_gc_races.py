"""A collection removes the objects its scan found least recently used, and only
those: not one read, or published again, while it ran; never a file reached through
a fan-out directory turned into a link; and a pool whose objects it may not remove
costs a few warning lines, not one per object."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.store import ArtifactPool, _maintenance

SIZE = 1000


def _pool(root: Path, count: int) -> tuple[ArtifactPool, list[str]]:
    """A pool of ``count`` objects of SIZE bytes, the first the least recently used."""
    pool = ArtifactPool(root)
    shas = []
    for i in range(count):
        sha = pool.put(bytes([i % 251]) * (SIZE - 4) + i.to_bytes(4, "big"))
        os.utime(pool.layout.object_path(sha), ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
        shas.append(sha)
    return pool, shas


def _after_scan(monkeypatch: pytest.MonkeyPatch, action: object) -> None:
    """Run ``action`` once the collection's scan has listed every object, before it
    removes any (as a process working on the pool meanwhile would)."""
    real = _maintenance.scan_objects

    def scan(*args: object) -> Iterator[tuple[str, str, os.stat_result]]:
        found = list(real(*args))  # type: ignore[arg-type]
        action()  # type: ignore[operator]
        yield from found

    monkeypatch.setattr(_maintenance, "scan_objects", scan)


def test_an_object_read_during_the_scan_is_not_collected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, (oldest, newer) = _pool(tmp_path / "pool", 2)
    reader = ArtifactPool(tmp_path / "pool")  # another process's open of the pool
    _after_scan(monkeypatch, lambda: reader.get(oldest))  # a read refreshes its stamp

    report = pool.gc(SIZE)

    # The object just read is the most recently used now: the other one goes.
    assert pool.has(oldest)
    assert not pool.has(newer)
    assert (report.removed, report.kept, report.kept_bytes) == (1, 1, SIZE)


def test_an_object_published_again_during_the_scan_is_not_collected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, (oldest, newer) = _pool(tmp_path / "pool", 2)
    data = Path(pool.layout.object_path(oldest)).read_bytes()  # no stamp moved
    writer = ArtifactPool(tmp_path / "pool")

    def publish_again() -> None:
        # Removed (pruned, quarantined) and published again by another process, which
        # keeps the bytes' old stamp (a copy that preserves times): a new file.
        path = writer.layout.object_path(oldest)
        stamp = os.lstat(path).st_mtime_ns
        os.unlink(path)
        writer.put(data)
        os.utime(path, ns=(stamp, stamp))

    _after_scan(monkeypatch, publish_again)
    pool.gc(SIZE)

    assert pool.get(oldest) == data
    assert not pool.has(newer)


def test_a_fanout_turned_into_a_link_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, (oldest, _newer) = _pool(tmp_path / "pool", 2)
    outside = tmp_path / "outside"
    outside.mkdir()
    fanout = Path(pool.layout.fanout(oldest))
    # A hard link of the object outside the pool (as a materialized file is).
    os.link(pool.layout.object_path(oldest), outside / oldest)

    def swap() -> None:
        for entry in fanout.iterdir():
            if entry.name != oldest:
                os.link(entry, outside / entry.name)
        os.rename(fanout, tmp_path / "moved-fanout")
        os.symlink(outside, fanout)

    _after_scan(monkeypatch, swap)
    pool.gc(SIZE)

    assert (outside / oldest).is_file()
    assert (tmp_path / "moved-fanout" / oldest).is_file()


def test_objects_that_cannot_be_removed_are_summed_up_not_logged_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool, shas = _pool(tmp_path / "pool", 40)
    real_unlink = os.unlink
    objects = set(shas)

    def refuse(path: str, *args: object, **kwargs: object) -> None:
        if os.path.basename(path) in objects:  # another user's pool: EACCES each
            raise PermissionError(errno.EACCES, "Permission denied", path)
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="distcache.store._maintenance"):
        report = pool.gc(0)
    monkeypatch.undo()

    assert (report.removed, report.kept) == (0, 40)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "distcache.store._maintenance"]
    assert 1 <= len(lines) <= 4, lines
    assert "40 objects" in lines[-1] and "Permission denied" in lines[-1]
    assert all(pool.has(sha) for sha in shas)
