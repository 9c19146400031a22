"""FlashInfer's JIT through the pool: ninja, run in a directory filled from the pool,
has nothing to do (files keep their modification times, and ninja's own logs are
published); FlashInfer's downloaded cubins stay out of the family; a time a tree
carries is checked and never placed in the future; a new time alone publishes
nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from distcache import jit
from distcache.artifact import Artifact
from distcache.errors import JitCacheError
from distcache.jit import Family, TreeEntry, TreeManifest
from distcache.jit._tree import publish_tree, tree_label
from distcache.store import ArtifactPool
from tests.unit.test_jit_family import fill, spec

#: Where FlashInfer puts one op: ``<cache>/<version>/<archs>/{generated,cached_ops}``.
WS = "0.7.4/90"
OP = {f"{WS}/generated/op/kernel.cu": b"// kernel source\n",
      f"{WS}/cached_ops/op/build.ninja": b"rule cc\n  command = cp $in $out\n",
      f"{WS}/cached_ops/op/kernel.cuda.o": b"\x7fELF object" * 20,
      f"{WS}/cached_ops/op/op.so": b"\x7fELF shared" * 30,
      f"{WS}/cached_ops/op/.ninja_log": b"# ninja log v5\n0\t9\t123\top.so\tabc\n",
      f"{WS}/cached_ops/op/.ninja_deps": b"# ninjadeps\n\x04\x00\x00\x00"}
CUBIN = "cubins/pin/fmha/trtllm-gen/fmhaSm100aKernel_x.cubin"
#: The latest time a tree may carry (ns; ``_tree.MAX_MTIME_NS``), far in the future.
LATEST = 2**63 - 1


def flashinfer(tmp_path: Path, pool: ArtifactPool) -> Family:
    """The ``flashinfer_jit`` family of a node whose workspace base is
    ``tmp_path/ws`` (every node of a test has the same path, so the same key)."""
    env = {"HOME": str(tmp_path / "home"), "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "ws")}
    return jit.family("flashinfer_jit", pool=pool, environ=env)


def root_of(family: Family) -> Path:
    return family.spec.roots[0].path


def test_a_round_trip_keeps_times_and_ninja_logs_and_leaves_cubins_out(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    node_a = flashinfer(tmp_path, pool)
    root = root_of(node_a)
    fill(root, {**OP, CUBIN: os.urandom(4096)})
    times = {}
    for i, rel in enumerate(sorted(OP)):  # times unlike the order files are placed in
        os.utime(root / rel, ns=(1_700_000_000_000_000_000, 1_700_000_000_123_456_789 - i))
        times[rel] = os.stat(root / rel).st_mtime_ns
    assert node_a.publish() == len(OP)
    served = node_a.merged().entries
    # ninja's logs are published, FlashInfer's downloaded cubins are not.
    assert sorted(served) == sorted(OP)
    assert {p: e.mtime_ns for p, e in served.items()} == times
    # Node B: the same path, an empty cache.
    shutil.rmtree(tmp_path / "ws")
    node_b = flashinfer(tmp_path, pool)
    placed = node_b.materialize()
    assert (placed.written, placed.missing) == (len(OP), 0)
    for rel, data in OP.items():
        assert (root / rel).read_bytes() == data
        assert os.stat(root / rel).st_mtime_ns == times[rel], rel
    assert not (root / "cubins").exists()
    assert node_b.publish() == 0


def ninja(ops: Path, *args: str) -> str:
    found = shutil.which("ninja")
    assert found is not None
    done = subprocess.run([found, "-C", str(ops), "-f", "build.ninja", *args],
                          capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def test_ninja_on_a_node_filled_from_the_pool_has_nothing_to_do(tmp_path: Path) -> None:
    if shutil.which("ninja") is None:
        pytest.skip("ninja is not installed (shutil.which('ninja') found none); this "
                    "test runs FlashInfer-style ninja builds")
    pool = ArtifactPool(tmp_path / "pool")
    node_a = flashinfer(tmp_path, pool)
    gen = root_of(node_a) / WS / "generated" / "op"
    ops = root_of(node_a) / WS / "cached_ops" / "op"
    header = gen / "kernel.h"
    fill(gen, {"kernel.cu": b"// kernel source\n", "kernel.h": b"// header\n"})
    # FlashInfer's build.ninja: absolute paths, a depfile read into .ninja_deps.
    fill(ops, {"build.ninja": f"""rule cc
  command = cat $in > $out && printf '%s: %s %s\\n' $out $in {header} > $out.d
  depfile = $out.d
  deps = gcc
rule link
  command = cat $in > $out
build {ops}/kernel.cuda.o: cc {gen}/kernel.cu
build {ops}/op.so: link {ops}/kernel.cuda.o
default {ops}/op.so
""".encode()})
    assert "cat" in ninja(ops)
    assert "no work to do" in ninja(ops, "-n")
    assert (ops / ".ninja_log").is_file() and (ops / ".ninja_deps").is_file()
    assert node_a.publish() > 0
    # Node B: the same path, an empty cache, filled from the pool.
    shutil.rmtree(tmp_path / "ws")
    assert flashinfer(tmp_path, pool).materialize().missing == 0
    explained = ninja(ops, "-n", "-d", "explain")
    assert "no work to do" in explained and "dirty" not in explained, explained
    # ... and ninja still knows what the op depends on: a newer header rebuilds it.
    newest = max(os.stat(ops / n).st_mtime_ns for n in ("kernel.cuda.o", "op.so"))
    os.utime(header, ns=(newest + 10**9, newest + 10**9))
    assert "kernel.cuda.o" in ninja(ops, "-n")


def _stored(pool: ArtifactPool, files: dict[str, bytes]) -> tuple[TreeEntry, ...]:
    """Entries without times for ``files``, whose bytes ``pool`` then holds."""
    return tuple(TreeEntry(rel, pool.put(data), 0o644, len(data))
                 for rel, data in sorted(files.items()))


def _label(pool: ArtifactPool, key: str, raw: bytes) -> None:
    sha = pool.put(raw)
    pool.remember([Artifact(tree_label("flashinfer_jit", key, sha), sha, len(raw))])


def test_a_time_from_a_tree_is_checked_clamped_or_absent(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    family = flashinfer(tmp_path, pool)
    entries = _stored(pool, {"a/future.o": b"from the future", "a/old.o": b"no time",
                             CUBIN: b"cubin of an old tree"})
    doc = json.loads(TreeManifest("flashinfer_jit", family.key, entries,
                                  "0123456789abcdef", 1).encode())
    raw = json.dumps({**doc, "mtime_ns": [LATEST, None, None]},
                     separators=(",", ":"), sort_keys=True).encode()
    _label(pool, family.key, raw)
    placed = family.materialize()
    after = time.time_ns()
    root = root_of(family)
    # The absurd time is clamped to the placing, the entry without one is placed as
    # before, and a cubin an older tree lists is not placed.
    assert placed.written == 2
    assert 0 < os.stat(root / "a" / "future.o").st_mtime_ns <= after
    assert (root / "a" / "old.o").read_bytes() == b"no time"
    assert not (root / "cubins").exists()
    tree = TreeManifest.decode(raw)
    assert [e.mtime_ns for e in tree.entries] == [LATEST, None, None]
    assert tree.encode() == raw
    # A time that is not a whole number of ns in 0..2^63-1 makes the tree malformed.
    for bad in (-1, LATEST + 1, True, 1.5, "7", [1]):
        with pytest.raises(JitCacheError, match="malformed tree manifest"):
            TreeManifest.decode(json.dumps({**doc, "mtime_ns": [bad, None, None]}).encode())
    for bad_list in ([1, None], {"a/old.o": 1}, 7):
        with pytest.raises(JitCacheError, match="malformed tree manifest"):
            TreeManifest.decode(json.dumps({**doc, "mtime_ns": bad_list}).encode())


def test_a_new_time_alone_publishes_nothing_and_a_timeless_entry_is_upgraded_once(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    family = flashinfer(tmp_path, pool)
    fill(root_of(family), OP)
    # What a distcache that kept no times published, as this publisher and another
    # (which comes first).
    timeless = _stored(pool, OP)
    for who in (family.publisher, "0" * 16):
        publish_tree(pool, TreeManifest("flashinfer_jit", family.key, timeless, who, 1))
    # Published once more, with times; served before the other publisher's.
    assert family.publish() == len(OP)
    assert all(e.mtime_ns is not None for e in family.merged().entries.values())
    assert family.publish() == 0
    # Only the time moves: nothing to publish, for this process or a later one.
    for rel in OP:
        os.utime(root_of(family) / rel, ns=(1_600_000_000_000_000_000,) * 2)
    assert family.publish() == 0
    assert flashinfer(tmp_path, pool).publish() == 0
    # A family keeps no times unless its spec says so: its trees are as before.
    fill(tmp_path / "ind", {"ab/k.so": b"\x7fELF"})
    assert Family(spec(tmp_path / "ind"), pool).publish() == 1
    (tree,) = jit.read_trees(pool, "inductor", spec(tmp_path / "ind").key)
    assert tree.entries[0].mtime_ns is None
    assert "mtime_ns" not in json.loads(tree.encode())
