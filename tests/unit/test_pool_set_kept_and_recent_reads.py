"""What a capped import keeps, and what a prune counts as recently read."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from distcache.artifact import Artifact
from distcache.store import ArtifactPool
from tests.support.cli import cli_env, run_cli


def _set(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True)
    lines = []
    for name, data in files.items():
        (directory / name).write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    (directory / "checksums.txt").write_text("".join(lines))


def test_an_import_over_the_cap_keeps_the_members_the_pool_already_held(tmp_path: Path) -> None:
    # The set's objects already in the pool are part of it as much as those the import
    # writes: the collection at the import's end goes around both.
    a, b, c = b"A" * 1000, b"B" * 1000, b"C" * 1000
    _set(tmp_path / "one", {"a.cubin": a})
    _set(tmp_path / "three", {"a.cubin": a, "b.cubin": b, "c.cubin": c})
    env = {**cli_env(tmp_path), "DISTCACHE_POOL_MAX_BYTES": "2500"}
    pool = tmp_path / "pool"
    for source in ("one", "three"):
        done = run_cli(env, "--pool", str(pool), "pool", "import", str(tmp_path / source))
        assert done.returncode == 0, done.stderr
    held = ArtifactPool(pool)
    for name, data in (("a.cubin", a), ("b.cubin", b), ("c.cubin", c)):
        assert held.get(hashlib.sha256(data).hexdigest()) == data, name
        assert held.names()[name] == hashlib.sha256(data).hexdigest()


def test_an_object_read_within_the_duration_is_not_pruned(tmp_path: Path) -> None:
    # A read refreshes a stamp only once it is a minute old: an object stamped 50 s ago
    # and read just now was used within the last 30 s, and stays.
    pool = ArtifactPool(tmp_path / "pool")
    read = pool.put(b"read" * 100)
    idle = pool.put(b"idle" * 100)
    pool.remember([Artifact("read.cubin", read), Artifact("idle.cubin", idle)])
    now = time.time()
    for sha, age in ((read, 50), (idle, 3 * 3600)):
        os.utime(pool.layout.object_path(sha), (now - age, now - age))
    assert pool.get(read) is not None  # a job reads it now; its stamp stays 50 s old
    done = run_cli(cli_env(tmp_path), "--pool", str(pool.root), "pool", "prune",
                   "--older-than", "30s", "--yes")
    assert done.returncode == 0, done.stderr
    after = ArtifactPool(pool.root)
    assert after.has(read) and after.names().get("read.cubin") == read
    assert not after.has(idle) and "idle.cubin" not in after.names()
