"""``names.log`` is read a chunk at a time: a long stretch without records (the
zero-filled tail a power loss leaves, a planted file) costs a pass over it, not its
size in memory, and the labels around it are still read."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from distcache.artifact import Artifact
from distcache.store import ArtifactPool

ZEROS = 48 << 20


def _labelled(root: Path, names: list[str]) -> tuple[ArtifactPool, dict[str, str]]:
    pool = ArtifactPool(root)
    labels = {}
    for name in names:
        sha = pool.put(name.encode())
        pool.label([Artifact(name=name, sha256=sha)])
        labels[name] = sha
    return pool, labels


def _zero_stretch(log: Path) -> None:
    with open(log, "ab") as f:
        f.truncate(f.tell() + ZEROS)  # read back as zeros, as a power loss leaves them
        f.seek(0, 2)
        f.write(b"\n")


def _peak_of(call: object) -> int:
    tracemalloc.start()
    try:
        call()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_zero_filled_stretch_is_not_held_in_memory(tmp_path: Path) -> None:
    pool, labels = _labelled(tmp_path / "pool", ["pin/a.cubin"])
    _zero_stretch(pool.layout.names_log)
    _later, more = _labelled(tmp_path / "pool", ["pin/b.cubin"])
    labels.update(more)

    fresh = ArtifactPool(tmp_path / "pool", read_only=True)  # reads the log from its start
    found: dict[str, str] = {}
    peak = _peak_of(lambda: found.update(fresh.names()))

    assert found == labels
    assert peak < 8 << 20, f"read names.log with a peak of {peak} bytes"


def test_stats_of_a_pool_with_a_zero_filled_log_stays_small(tmp_path: Path) -> None:
    pool, _labels = _labelled(tmp_path / "pool", ["pin/a.cubin", "pin/b.cubin"])
    _zero_stretch(pool.layout.names_log)

    fresh = ArtifactPool(tmp_path / "pool", read_only=True)
    stats: list[object] = []
    peak = _peak_of(lambda: stats.append(fresh.stats()))

    assert stats[0].names == 2  # type: ignore[attr-defined]
    assert peak < 8 << 20, f"pool stats read names.log with a peak of {peak} bytes"


def test_records_appended_after_the_stretch_are_read_incrementally(tmp_path: Path) -> None:
    pool, labels = _labelled(tmp_path / "pool", ["pin/a.cubin"])
    _zero_stretch(pool.layout.names_log)
    assert pool.names() == labels  # this process has read past the stretch

    _writer, more = _labelled(tmp_path / "pool", ["pin/c.cubin"])
    peak = _peak_of(lambda: labels.update(pool.names()))

    assert labels == {"pin/a.cubin": labels["pin/a.cubin"], **more}
    assert peak < 1 << 20
