"""Keys and directories that are not UTF-8: a cache directory named in another
encoding (Python reads its name with lone surrogates) is a family like any other,
and a tree whose key carries a lone surrogate is ignored or listed, never raised
from the start-up prefetch's listing or from ``pool ls --family``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from distcache import jit
from distcache.artifact import Artifact
from distcache.jit._tree import held_labels, key_id, publisher_id
from distcache.store import ArtifactPool

#: ``café`` as Latin-1 bytes, as Python reads a file name that is not UTF-8.
LATIN1 = os.fsdecode(b"caf\xe9")


def test_a_cache_directory_named_in_latin1_publishes_and_fills(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    directory = tmp_path / LATIN1
    (directory / "kernels").mkdir(parents=True)
    (directory / "kernels" / "gemm.so").write_bytes(b"\x7fELF" + b"g" * 64)
    environ = {"DG_JIT_CACHE_DIR": str(directory), "HOME": str(tmp_path)}
    family = jit.family("deep_gemm", pool=pool, environ=environ)
    assert family.publish() == 1
    (directory / "kernels" / "gemm.so").unlink()
    again = jit.family("deep_gemm", pool=pool, environ=environ)
    assert again.materialize().written == 1
    assert (directory / "kernels" / "gemm.so").read_bytes() == b"\x7fELF" + b"g" * 64


def test_ids_of_keys_and_directories_with_lone_surrogates_are_stable() -> None:
    assert key_id("dir=/x/" + LATIN1) == key_id("dir=/x/" + LATIN1)
    assert key_id("dir=/x/" + LATIN1) != key_id("dir=/x/cafe")
    assert len(publisher_id("host", ["/x/" + LATIN1])) == 16
    # Valid UTF-8 keys keep the ids their labels already carry.
    assert key_id("dir=/x/café") == key_id("dir=/x/caf\u00e9")


def test_a_tree_whose_key_has_a_lone_surrogate_does_not_break_listing(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    blob = pool.put(b"x")
    doc = {"version": 1, "family": "inductor", "key": "k\ud800",
           "files": [["a", blob, 0o644, 1]]}
    data = json.dumps(doc).encode("ascii")
    sha = pool.put(data)
    label = f"jit/inductor/{'0' * 24}/tree/{sha}"
    pool.remember([Artifact(label, sha, len(data))])
    # The label's key id is not the tree's: the tree is not grouped, but listing
    # goes on (the label itself is kept, as any tree label).
    assert [a.name for a in held_labels(pool, "inductor")] == [label]
    assert jit.summarize(pool) == []
