"""Placing a file whose tree keeps its time survives a sweep of stale temporary files
run by another rank at the same moment, while a temporary file left long ago is still
swept; and a tree read once is served again only under its own family and key."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.jit import Family, TreeEntry, TreeManifest, _place, _tree, read_trees
from distcache.jit._tree import publish_tree, tree_label
from distcache.store import ArtifactPool
from tests.unit.test_jit_family import spec
from tests.unit.test_jit_ninja_reuse import flashinfer, root_of

#: A modification time well over an hour ago (ns).
LONG_AGO_NS = 1_700_000_000 * 10**9
OP_DIR = "0.7.4/90/cached_ops/op"
TMP_NAME = ".op.so.1234.0badf00d.distcache.tmp"


def test_a_sweep_between_write_and_link_leaves_a_kept_time_file_to_be_placed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    publisher = flashinfer(tmp_path, pool)
    root = root_of(publisher)
    files = {"op.so": b"\x7fELF shared" * 30, "kernel.cuda.o": b"\x7fELF object" * 20}
    (root / OP_DIR).mkdir(parents=True)
    for name, data in files.items():
        (root / OP_DIR / name).write_bytes(data)
        os.utime(root / OP_DIR / name, ns=(LONG_AGO_NS, LONG_AGO_NS))
    assert publisher.publish() == len(files)
    shutil.rmtree(root)

    # Another rank sweeps the directory just as this one has written a temporary file
    # of a file whose tree keeps an old time, and not yet linked it into place.
    seen: list[list[str]] = []
    real_fsync = os.fsync

    def fsync_then_sweep(fd: int) -> None:
        real_fsync(fd)
        directory = root / OP_DIR
        temporaries = [n for n in os.listdir(directory) if n.endswith(".distcache.tmp")]
        _place._sweep_stale(directory)
        seen.append([n for n in temporaries if (directory / n).exists()])

    monkeypatch.setattr(os, "fsync", fsync_then_sweep)
    placed = flashinfer(tmp_path, pool).materialize()
    monkeypatch.undo()

    assert len(seen) == len(files) and all(len(kept) == 1 for kept in seen)
    assert placed.written == len(files)
    for name, data in files.items():
        assert (root / OP_DIR / name).read_bytes() == data
        assert os.stat(root / OP_DIR / name).st_mtime_ns == LONG_AGO_NS
    assert not [n for n in os.listdir(root / OP_DIR) if n.endswith(".distcache.tmp")]


def test_a_temporary_file_left_long_ago_is_still_swept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    left = tmp_path / TMP_NAME
    left.write_bytes(b"its writer was killed")
    os.utime(left, ns=(LONG_AGO_NS, LONG_AGO_NS))
    young = tmp_path / ".op.so.4343.cafecafe.distcache.tmp"  # one still being written
    young.write_bytes(b"being written")
    visible = tmp_path / "op.so.distcache.tmp"  # not hidden: not a placement's
    visible.write_bytes(b"someone's file")
    other = tmp_path / ".op.so.tmp"  # hidden, but not a placement's name
    other.write_bytes(b"someone's file")
    _place._sweep_stale(tmp_path)
    assert not left.exists()
    assert young.exists() and visible.exists() and other.exists()
    # Once old enough, any placement's temporary file is taken for a stale one.
    monkeypatch.setattr(_place, "STALE_TMP_S", -3600.0)
    _place._sweep_stale(tmp_path)
    assert not young.exists()
    assert visible.exists() and other.exists()


OLD = "torch=2.4.0;py=3.11;linux-x86_64;cpu=aaaa;dir=/c"
NEW = "torch=2.6.0;py=3.11;linux-x86_64;cpu=aaaa;dir=/c"


def _old_tree_under_new_label(pool: ArtifactPool) -> tuple[Artifact, bytes]:
    """A tree of key ``OLD``, also labelled under ``NEW``'s key id."""
    blob = b"\x7fELF built for torch 2.4"
    sha = pool.put(blob)
    old_tree = publish_tree(pool, TreeManifest(
        "inductor", OLD, (TreeEntry("k/kernel.so", sha, 0o755, len(blob)),), "0" * 16, 1))
    pool.remember([Artifact(tree_label("inductor", NEW, old_tree.sha256), old_tree.sha256)])
    return old_tree, blob


def test_a_cached_tree_of_another_key_is_ignored_under_this_keys_label(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    old_tree, _blob = _old_tree_under_new_label(pool)
    cache: dict[str, TreeManifest] = {}
    assert [t.key for t in read_trees(pool, "inductor", OLD, cache=cache)] == [OLD]
    assert old_tree.sha256 in cache
    assert read_trees(pool, "inductor", NEW) == []
    assert read_trees(pool, "inductor", NEW, cache=cache) == []
    assert read_trees(pool, "triton", OLD, names={
        tree_label("triton", OLD, old_tree.sha256): old_tree.sha256}, cache=cache) == []


def test_a_family_places_no_file_of_another_keys_tree_it_has_read(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    _old_tree_under_new_label(pool)
    family = Family(spec(tmp_path / "cache", key=NEW), pool, publisher="1" * 16)
    family.manifest()  # reads and keeps the trees of every key
    assert family.merged().entries == {}
    placed = family.materialize()
    assert placed.written == 0
    assert not (tmp_path / "cache/k/kernel.so").exists()


def test_a_cached_tree_of_this_key_is_served_without_reading_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    old_tree, _blob = _old_tree_under_new_label(pool)
    cache: dict[str, TreeManifest] = {}
    first = read_trees(pool, "inductor", OLD, cache=cache)

    def no_read(_pool: ArtifactPool, sha: str) -> bytes | None:
        raise AssertionError(f"tree {sha} read again")

    monkeypatch.setattr(_tree, "tree_bytes", no_read)
    assert read_trees(pool, "inductor", OLD, cache=cache) == first
    assert [t.key for t in first] == [OLD] and old_tree.sha256 in cache
