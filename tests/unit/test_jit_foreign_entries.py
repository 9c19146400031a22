"""Another user's files and directories inside a JIT cache directory of one's own.

Publishing stored files another user wrote into this user's cache directory (a
directory shared by group, say): every node filling from the pool then ran their code.
They are now left out, with a warning. Materialising stopped at the first directory
below the root that was another user's or a symbolic link, the files after it in order
never written: such a directory now keeps its place like a file in the way, the entries
under it left out and the others written. The root itself is still refused
(test_jit_place_paths.py), but a family's other roots are now filled and published
first: Inductor's second directory (torch's default, for precompiled headers) being
another user's no longer costs the user's own TORCHINDUCTOR_CACHE_DIR its files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from distcache import jit
from distcache.errors import JitCacheError
from distcache.jit import Family, FamilySpec, Root
from distcache.store import ArtifactPool

OTHER_UID = 4343
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="making a file or directory another user's needs root (chown)")


def _family(root: Path, pool: ArtifactPool, publisher: str | None = None) -> Family:
    return Family(FamilySpec("vllm", "k1", (Root(root),)), pool, publisher=publisher)


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and not p.is_symlink())


def _published(tmp_path: Path) -> ArtifactPool:
    """A pool holding a tree of ``a/k.so``, ``b/x.so`` and ``c.py``, all this user's."""
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    (built / "a").mkdir(parents=True)
    (built / "b").mkdir()
    for rel in ("a/k.so", "b/x.so", "c.py"):
        (built / rel).write_bytes(rel.encode() * 10)
    past = 1_000_000_000
    for rel in ("a/k.so", "b/x.so", "c.py"):
        os.utime(built / rel, (past, past))  # settled: stored at once
    assert _family(built, pool).publish() == 3
    return pool


@needs_root
def test_another_users_files_are_left_out_of_a_publication(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    cache = tmp_path / "cache"
    (cache / "mine").mkdir(parents=True)
    (cache / "theirs").mkdir()
    (cache / "mine" / "k.so").write_bytes(b"mine" * 10)
    (cache / "theirs" / "evil.so").write_bytes(b"theirs" * 10)
    (cache / "evil.py").write_bytes(b"import os" * 10)
    os.chown(cache / "theirs", OTHER_UID, OTHER_UID)
    os.chown(cache / "theirs" / "evil.so", OTHER_UID, OTHER_UID)
    os.chown(cache / "evil.py", OTHER_UID, OTHER_UID)
    for path in (cache / "mine" / "k.so", cache / "theirs" / "evil.so", cache / "evil.py"):
        os.utime(path, (1_000_000_000, 1_000_000_000))
    with caplog.at_level(logging.WARNING, logger="distcache.jit"):
        assert _family(cache, pool).publish() == 1
    other = tmp_path / "other"
    _family(other, pool, publisher="f" * 16).materialize()
    assert _files(other) == ["mine/k.so"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "evil.py" in said and "evil.so" in said and f"uid {OTHER_UID}" in said


@needs_root
def test_another_users_directory_below_the_root_keeps_its_place_and_the_rest_is_placed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _published(tmp_path)
    dest = tmp_path / "dest"
    (dest / "b").mkdir(parents=True)
    os.chown(dest / "b", OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="distcache.jit"):
        placed = _family(dest, pool, publisher="f" * 16).materialize()
    assert _files(dest) == ["a/k.so", "c.py"]
    assert (placed.written, placed.kept) == (2, 1)
    warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warned) == 1 and f"uid {OTHER_UID}" in warned[0]


def test_a_link_below_the_root_is_not_written_through_and_the_rest_is_placed(
    tmp_path: Path,
) -> None:
    pool = _published(tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dest / "b").symlink_to(elsewhere)
    placed = _family(dest, pool, publisher="f" * 16).materialize()
    assert _files(dest) == ["a/k.so", "c.py"]
    assert list(elsewhere.iterdir()) == []
    assert (placed.written, placed.kept) == (2, 1)


def _theirs_default(tmp_path: Path) -> dict[str, str]:
    """Inductor's environment: the cache in ``tmp_path/cache``, torch's default
    directory (the headers' root) another user's."""
    tmpdir = tmp_path / "tmpdir"
    theirs = tmpdir / "torchinductor_u"
    (theirs / "precompiled_headers").mkdir(parents=True)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmpdir),
            "USER": "u"}


@needs_root
def test_a_refused_headers_root_leaves_the_cache_directory_published_and_filled(
    tmp_path: Path,
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    environ = _theirs_default(tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "x.so").write_bytes(b"kernel" * 10)
    os.utime(tmp_path / "cache" / "x.so", (1_000_000_000, 1_000_000_000))
    family = jit.family("inductor", pool=pool, environ=environ)
    with pytest.raises(JitCacheError, match="belongs to uid"):
        family.publish()
    assert list(family.merged().entries) == ["x.so"]  # stored before the refusal
    (tmp_path / "cache" / "x.so").unlink()
    again = jit.family("inductor", pool=pool, environ=environ)
    with pytest.raises(JitCacheError, match="belongs to uid"):
        again.materialize()
    assert (tmp_path / "cache" / "x.so").read_bytes() == b"kernel" * 10
