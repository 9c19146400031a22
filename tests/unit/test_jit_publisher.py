"""A file that one publisher rewrites is an update; two publishers that give one path
different bytes are a conflict. Trees written before publishers existed (format 1)
are still read, each as a publisher of its own."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from distcache import jit
from distcache.artifact import sha256_hex
from distcache.errors import JitCacheError
from distcache.jit import Family, FamilySpec, Root, TreeEntry, TreeManifest
from distcache.jit._tree import publish_tree, publisher_id
from distcache.store import ArtifactPool

KEY = "tool=1;py=3.11;linux"


def spec(root: Path) -> FamilySpec:
    return FamilySpec("vllm", KEY, (Root(root),))


def write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a new file each start, as vLLM writes it
        path.write_bytes(data)


def blob_labels(family: Family) -> set[str]:
    return {a.name.rsplit("/", 1)[1] for a in family.manifest() if "/blob/" in a.name}


def test_a_publisher_that_rewrites_a_file_supersedes_its_own_entry(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "torch_compile_cache"
    stable = {"h/inductor_cache/k.so": b"kernel" * 100}
    versions = [b"model of start %d" % i * 50 for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="distcache.jit"):
        for start, model in enumerate(versions):
            # Every start rewrites both ranks' model with new bytes, as vLLM on CPU does.
            write(root, {**stable, "h/rank_0_0/model": model, "h/rank_1_0/model": model})
            family = Family(spec(root), pool)
            assert family.materialize().written == 0
            assert family.publish() == (3 if start == 0 else 2)
    trees = jit.read_trees(pool, "vllm", KEY)
    assert sorted(t.seq for t in trees) == [1, 2, 3]
    assert len({t.publisher for t in trees}) == 1
    merged = jit.union(trees)
    assert merged.conflicts == {}
    newest = sha256_hex(versions[-1])
    assert merged.entries["h/rank_0_0/model"].sha256 == newest
    assert merged.entries["h/rank_1_0/model"].sha256 == newest
    assert not [r for r in caplog.records if "different bytes" in r.getMessage()]
    # A fresh directory is served the newest version.
    fresh = tmp_path / "fresh"
    placed = Family(spec(fresh), pool).materialize()
    assert placed.written == 3
    assert (fresh / "h" / "rank_1_0" / "model").read_bytes() == versions[-1]
    # Only the served versions are prefetched to other pools; the older ones stay
    # unread here, for gc to collect first.
    family = Family(spec(root), pool)
    assert blob_labels(family) == {newest, sha256_hex(stable["h/inductor_cache/k.so"])}
    assert sum("/tree/" in a.name for a in family.manifest()) == 3
    # Back to an older version's bytes: a fourth tree, and that version is served.
    write(root, {"h/rank_0_0/model": versions[0]})
    assert family.publish() == 1
    merged = jit.union(jit.read_trees(pool, "vllm", KEY))
    assert merged.entries["h/rank_0_0/model"].sha256 == sha256_hex(versions[0])
    assert merged.entries["h/rank_1_0/model"].sha256 == newest


def test_two_publishers_with_different_bytes_are_a_conflict_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    # Two hosts with the same directory path (the key is equal): two publishers.
    a, b = tmp_path / "host_a", tmp_path / "host_b"
    write(a, {"same": b"equal bytes", "model": b"host a's model"})
    write(b, {"same": b"equal bytes", "model": b"host b's model"})
    first = Family(spec(a), pool, publisher=publisher_id("host-a", ["/cache"]))
    second = Family(spec(b), pool, publisher=publisher_id("host-b", ["/cache"]))
    assert first.publisher != second.publisher
    assert first.publish() == 2
    assert second.publish() == 1  # "same" agrees and is not listed again
    fresh = tmp_path / "fresh"
    reader = Family(spec(fresh), pool)
    with caplog.at_level(logging.WARNING, logger="distcache.jit"):
        reader.materialize()
        assert reader.report.conflicts == 1
        reader.materialize()
        assert reader.report.conflicts == 0
    assert sorted(p.name for p in fresh.iterdir()) == ["same"]
    warned = [r for r in caplog.records if "model" in r.getMessage()]
    assert len(warned) == 1 and "not shared" in warned[0].getMessage()
    # Neither version travels to other pools, and republishing either changes nothing.
    assert blob_labels(reader) == {sha256_hex(b"equal bytes")}
    assert first.publish() == 0 and second.publish() == 0
    # A publisher that rewrites its side keeps the conflict (two publishers still
    # disagree) until its bytes equal the other's.
    write(a, {"model": b"host a's second model"})
    assert first.publish() == 1
    assert "model" in jit.union(jit.read_trees(pool, "vllm", KEY)).conflicts
    write(a, {"model": b"host b's model"})
    assert first.publish() == 1
    merged = jit.union(jit.read_trees(pool, "vllm", KEY))
    assert merged.conflicts == {}
    assert merged.entries["model"].sha256 == sha256_hex(b"host b's model")


def format_1(entries: dict[str, bytes]) -> bytes:
    """A tree as distcache wrote it before trees named their publisher."""
    files = [[p, sha256_hex(d), 0o644, len(d)] for p, d in sorted(entries.items())]
    doc = {"version": 1, "family": "vllm", "key": KEY, "files": files}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def test_trees_of_format_1_are_read_each_as_a_publisher_of_its_own(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    for data in (b"old one", b"old two", b"shared"):
        pool.put(data)
    for files in ({"a": b"old one", "s": b"shared"}, {"a": b"old two", "s": b"shared"}):
        raw = format_1(files)
        tree = TreeManifest.decode(raw)
        assert (tree.publisher, tree.seq) == (None, 0)
        assert tree.encode() == raw  # written as it was read
        publish_tree(pool, tree)
    merged = jit.union(jit.read_trees(pool, "vllm", KEY))
    assert sorted(merged.conflicts) == ["a"] and sorted(merged.entries) == ["s"]
    # A tree of format 2 from this directory does not supersede them.
    root = tmp_path / "cache"
    write(root, {"a": b"new", "s": b"shared"})
    family = Family(spec(root), pool)
    assert family.publish() == 1
    trees = jit.read_trees(pool, "vllm", KEY)
    assert sorted(t.seq for t in trees) == [0, 0, 1]
    assert len(jit.union(trees).conflicts["a"]) == 3


def test_a_malformed_publisher_or_sequence_is_refused() -> None:
    entry = TreeEntry("a", sha256_hex(b"a"), 0o644, 1)
    good = json.loads(TreeManifest("vllm", KEY, (entry,), "0123456789abcdef", 4).encode())
    assert good["version"] == 2
    assert TreeManifest.decode(json.dumps(good).encode()).seq == 4
    for field, value in (("publisher", "../x"), ("publisher", 7), ("seq", -1),
                         ("seq", "1"), ("version", 3)):
        with pytest.raises(JitCacheError):
            TreeManifest.decode(json.dumps({**good, field: value}).encode())
    del good["publisher"]
    with pytest.raises(JitCacheError):
        TreeManifest.decode(json.dumps(good).encode())


def test_the_engine_exit_publishes_a_rewritten_model_as_an_update(tmp_path: Path) -> None:
    from distcache.integrations import _compile_caches

    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "vllm_root"
    environ = {"VLLM_CACHE_ROOT": str(root)}
    for start in range(3):
        chosen = jit.families(["vllm"], pool=pool, environ=environ)
        write(root / "torch_compile_cache",
              {"h/rank_0_0/model": b"start %d" % start, "h/rank_1_0/model": b"start %d" % start})
        rows = _compile_caches.publish_at_exit(chosen, "test", "main", os.getpid())
        assert rows == [{"name": "vllm", "files": 2, "seconds": rows[0]["seconds"]}]
    merged = jit.union(jit.read_trees(pool, "vllm", chosen[0].key))
    assert merged.conflicts == {}
    assert {e.sha256 for e in merged.entries.values()} == {sha256_hex(b"start 2")}
