"""The commands that only read a pool (``pool ls``, ``pool stats``) and every
``--dry-run`` change nothing there: no stale temporary or lock file is swept, no
missing directory is made, no format or id file is written; ``pool stats`` counts the
temporary files it finds. The pool object they open refuses every write."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.errors import PoolError
from distcache.store import ArtifactPool
from distcache.store.layout import FORMAT_VERSION
from tests.support.cli import cli_env, run_cli
from tests.support.helpers import clear_settings

_TWO_HOURS_AGO = time.time() - 2 * 3600


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pool(tmp_path: Path) -> Path:
    """A pool with two labelled objects, a crashed writer's temporary file and lock
    (both two hours old), and no ``quarantine/``."""
    root = tmp_path / "pool"
    pool = ArtifactPool(root)
    for name in ("sub/file_1.bin", "sub/file_2.bin"):
        data = name.encode() * 10
        pool.put(data)
        pool.remember([Artifact(name, _sha(data))])
    stale_tmp = root / "tmp" / "crashed.tmp"
    stale_tmp.write_bytes(b"partial\n")
    stale_lock = root / "locks" / "stale.lock"
    stale_lock.touch()
    for path in (stale_tmp, stale_lock):
        os.utime(path, (_TWO_HOURS_AGO, _TWO_HOURS_AGO))
    (root / "quarantine").rmdir()
    return root


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime (ns)."""
    found = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.mark.parametrize("argv", [
    ["pool", "ls"],
    ["pool", "ls", "--family"],
    ["pool", "stats"],
    ["pool", "rm", "sub/file_1.bin", "--dry-run"],
    ["pool", "prune", "--older-than", "1s", "--dry-run"],
    ["pool", "prune", "--older-than", "1d", "--dry-run"],
    ["prefetch", "--manifest", "MANIFEST", "--dry-run"],
], ids=["ls", "ls-family", "stats", "rm-dry-run", "prune-all-dry-run", "prune-dry-run",
        "prefetch-dry-run"])
def test_read_only_command_leaves_the_pool_tree_unchanged(tmp_path: Path,
                                                          argv: list[str]) -> None:
    root = _pool(tmp_path)
    manifest = tmp_path / "m.txt"
    manifest.write_text(f"{_sha(b'absent')}  absent.bin\n"
                        f"{_sha(b'sub/file_1.bin' * 10)}  sub/file_1.bin\n")
    argv = [str(manifest) if a == "MANIFEST" else a for a in argv]
    before = _tree(root)
    result = run_cli(cli_env(tmp_path), "--pool", str(root), *argv)
    assert result.returncode == 0, result.stderr
    assert _tree(root) == before


def test_stats_counts_the_stale_temporary_file(tmp_path: Path) -> None:
    root = _pool(tmp_path)
    result = run_cli(cli_env(tmp_path), "--pool", str(root), "pool", "stats", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["tmp_files"] == 1
    assert stats["objects"] == 2
    assert stats["quarantined"] == 0


def test_real_prune_still_sweeps(tmp_path: Path) -> None:
    """A command that writes still opens the pool as every writer does."""
    root = _pool(tmp_path)
    result = run_cli(cli_env(tmp_path), "--pool", str(root), "pool", "prune",
                     "--older-than", "1d", "--yes")
    assert result.returncode == 0, result.stderr
    assert not (root / "tmp" / "crashed.tmp").exists()
    assert not (root / "locks" / "stale.lock").exists()
    assert (root / "quarantine").is_dir()


def test_read_only_pool_refuses_every_write(tmp_path: Path) -> None:
    root = _pool(tmp_path)
    before = _tree(root)
    pool = ArtifactPool(root, read_only=True)
    data = b"sub/file_1.bin" * 10
    assert pool.get(_sha(data)) == data
    assert pool.stats().tmp_files == 1
    writes = [
        lambda: pool.put(b"new"),
        lambda: pool.remember([Artifact("x.bin", _sha(data))]),
        lambda: pool.label([Artifact("x.bin", _sha(data))]),
        lambda: pool.materialize(Artifact("sub/file_1.bin", _sha(data)), tmp_path / "out"),
        pool.verify,
        pool.gc,
        pool.sweep,
        pool.batch,
    ]
    for write in writes:
        with pytest.raises(PoolError, match="read-only"):
            write()
    assert _tree(root) == before
    assert not (tmp_path / "out").exists()


def test_read_only_get_leaves_a_corrupt_object_in_place(tmp_path: Path) -> None:
    root = _pool(tmp_path)
    sha = _sha(b"sub/file_1.bin" * 10)
    path = root / "objects" / sha[:2] / sha
    path.chmod(0o644)
    path.write_bytes(b"corrupt")
    before = _tree(root)
    assert ArtifactPool(root, read_only=True).get(sha) is None
    assert _tree(root) == before


def test_read_only_open_of_a_pool_with_no_format_or_id_writes_none(tmp_path: Path) -> None:
    root = _pool(tmp_path)
    (root / "format").unlink()
    (root / "pool_id").unlink()
    before = _tree(root)
    pool = ArtifactPool(root, read_only=True)
    assert pool.format_version == FORMAT_VERSION
    assert pool.pool_id == ""
    assert pool.stats().objects == 2
    assert _tree(root) == before


def test_read_only_open_of_no_pool_makes_none(tmp_path: Path) -> None:
    with pytest.raises(PoolError, match="no pool"):
        ArtifactPool(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()


def test_read_only_open_refuses_a_newer_format(tmp_path: Path) -> None:
    root = _pool(tmp_path)
    (root / "format").write_text(f"{FORMAT_VERSION + 1}\n")
    before = _tree(root)
    with pytest.raises(PoolError, match="newer"):
        ArtifactPool(root, read_only=True)
    result = run_cli(cli_env(tmp_path), "--pool", str(root), "pool", "stats")
    assert result.returncode != 0
    assert "newer" in result.stderr
    assert _tree(root) == before
