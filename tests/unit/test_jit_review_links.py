"""Linking a placed file into place fails: on a filesystem without hard links (some
FUSE and object-store mounts) or a full one, placing stops at the first file with a
``WholeFilesystem`` that says what to do, leaves no temporary file behind, and does
not try every other file in turn."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from distcache.jit import Family, FamilySpec, Root
from distcache.jit._tree import TreeEntry, TreeManifest, publish_tree
from distcache.jit._walk import WholeFilesystem
from distcache.store import ArtifactPool

KEY = "tool=1;py=3.11;linux"
FILES = {"a/one.so": b"1" * 10, "a/two.so": b"2" * 10, "b/three.so": b"3" * 10}


def _family(tmp_path: Path) -> tuple[Family, Path]:
    pool = ArtifactPool(tmp_path / "pool")
    entries = tuple(TreeEntry(rel, pool.put(data), 0o644, len(data))
                    for rel, data in FILES.items())
    publish_tree(pool, TreeManifest("deep_gemm", KEY, entries))
    root = tmp_path / "cache"
    return Family(FamilySpec("deep_gemm", KEY, (Root(root),)), pool), root


def _refuse_links(monkeypatch: pytest.MonkeyPatch, root: Path, code: int) -> list[str]:
    """``os.link`` into ``root`` fails with ``code``; the targets tried."""
    tried: list[str] = []
    real = os.link

    def link(src: str | os.PathLike[str], dst: str | os.PathLike[str],
             *args: object, **kwargs: object) -> None:
        if root in Path(dst).parents:
            tried.append(str(dst))
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
        real(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", link)
    return tried


def _leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.endswith(".distcache.tmp")]


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EPERM, errno.ENOSYS])
def test_a_filesystem_without_hard_links_stops_with_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    family, root = _family(tmp_path)
    tried = _refuse_links(monkeypatch, root, code)
    with pytest.raises(WholeFilesystem, match="cannot hard-link files") as caught:
        family.materialize()
    assert caught.value.errno == code
    assert caught.value.path == str(root / "a" / "one.so")  # type: ignore[attr-defined]
    assert len(tried) == 1
    assert _leftovers(root) == []


def test_a_full_filesystem_when_linking_is_whole_filesystem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    family, root = _family(tmp_path)
    tried = _refuse_links(monkeypatch, root, errno.ENOSPC)
    with pytest.raises(WholeFilesystem, match="make room") as caught:
        family.materialize()
    assert caught.value.errno == errno.ENOSPC
    assert len(tried) == 1
    assert _leftovers(root) == []
