"""Directories that cannot be made or are refused: a cache directory that cannot be
created is a ``JitCacheError`` naming the family and what to do (a full or read-only
filesystem a ``WholeFilesystem``), a subdirectory that cannot be created leaves only
its own entries out, and one family refused does not keep ``jit.materialize`` or
``jit.publish`` from the others."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from distcache import jit
from distcache.errors import JitCacheError
from distcache.jit import Family, FamilySpec, Root
from distcache.jit._tree import TreeEntry, TreeManifest, publish_tree
from distcache.jit._walk import WholeFilesystem
from distcache.store import ArtifactPool

KEY = "tool=1;py=3.11;linux"


def _refuse_mkdir(monkeypatch: pytest.MonkeyPatch, under: Path, code: int) -> None:
    """``os.mkdir`` fails with ``code`` for every directory at or below ``under``."""
    real = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: int, **kwargs: int) -> None:
        if Path(path) == under or under in Path(path).parents:
            raise OSError(code, os.strerror(code), str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)


def _serve(pool: ArtifactPool, name: str, key: str, files: dict[str, bytes]) -> None:
    """A tree of ``files`` for the family ``name`` under ``key``."""
    entries = tuple(TreeEntry(rel, pool.put(data), 0o644, len(data))
                    for rel, data in files.items())
    publish_tree(pool, TreeManifest(name, key, entries))


def _families(tmp_path: Path, pool: ArtifactPool) -> list[Family]:
    environ = {"DG_JIT_CACHE_DIR": str(tmp_path / "locked" / "dg"),
               "TRITON_CACHE_DIR": str(tmp_path / "triton"), "HOME": str(tmp_path)}
    chosen = jit.families(["deep_gemm", "triton"], pool=pool, environ=environ)
    for fam in chosen:
        _serve(pool, fam.name, fam.key, {"k/a.so": b"\x7fELF" + fam.name.encode()})
    return chosen


def test_a_cache_directory_that_cannot_be_created_names_family_and_remedy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    chosen = _families(tmp_path, pool)
    _refuse_mkdir(monkeypatch, tmp_path / "locked", errno.EACCES)
    with pytest.raises(JitCacheError, match="deep_gemm: cannot create") as caught:
        jit.materialize(chosen)
    assert "point the tool's cache variable" in str(caught.value)
    assert caught.value.path == str(tmp_path / "locked")  # type: ignore[attr-defined]
    # The other family is filled all the same.
    assert (tmp_path / "triton" / "k" / "a.so").read_bytes() == b"\x7fELFtriton"


def test_a_read_only_filesystem_under_a_new_cache_directory_is_whole_filesystem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    chosen = _families(tmp_path, pool)
    _refuse_mkdir(monkeypatch, tmp_path / "locked", errno.EROFS)
    with pytest.raises(WholeFilesystem) as caught:
        chosen[0].materialize()
    assert caught.value.errno == errno.EROFS


def test_a_subdirectory_that_cannot_be_created_leaves_only_its_entries_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "cache"
    files = {"aa/one.so": b"1", "bad/two.so": b"2", "bad/deep/three.so": b"3",
             "zz/four.so": b"4"}
    _serve(pool, "deep_gemm", KEY, files)
    root.mkdir()
    _refuse_mkdir(monkeypatch, root / "bad", errno.EACCES)
    family = Family(FamilySpec("deep_gemm", KEY, (Root(root),)), pool)
    with caplog.at_level(logging.WARNING, logger="distcache"):
        placed = family.materialize()
    assert (placed.written, placed.missing, placed.kept) == (2, 2, 0)
    assert (root / "aa" / "one.so").read_bytes() == b"1"
    assert (root / "zz" / "four.so").read_bytes() == b"4"
    warned = [r.getMessage() for r in caplog.records if "cannot create" in r.getMessage()]
    assert len(warned) == 1 and str(root / "bad") in warned[0]


def test_a_refused_family_does_not_keep_publish_from_the_others(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # every user may write to it, and no sticky bit: refused
    (shared / "dg").mkdir()
    (shared / "dg" / "a.so").write_bytes(b"dg")
    triton = tmp_path / "triton"
    (triton / "k").mkdir(parents=True)
    (triton / "k" / "a.so").write_bytes(b"triton")
    environ = {"DG_JIT_CACHE_DIR": str(shared / "dg"), "TRITON_CACHE_DIR": str(triton),
               "HOME": str(tmp_path)}
    chosen = jit.families(["deep_gemm", "triton"], pool=pool, environ=environ)
    with pytest.raises(JitCacheError, match="no sticky bit"):
        jit.publish(chosen)
    assert chosen[1].report.published == 1
    assert set(chosen[1].merged().entries) == {"k/a.so"}
