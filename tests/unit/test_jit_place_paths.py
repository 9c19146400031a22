"""The way to a JIT cache directory and the names placed in it: Inductor's second
directory (the precompiled headers under torch's default directory) is neither filled
nor published through a symbolic link another user planted or in another user's
directory, missing directories on the way are created one at a time, and one file that
cannot be placed is counted and logged while the rest are placed."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import pytest

from distcache import jit
from distcache.errors import JitCacheError
from distcache.jit import Family, FamilySpec, Root
from distcache.store import ArtifactPool

OTHER_UID = 4242
HEADER = b"PCH" * 100
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="making a directory or link another user's needs root (chown)")


def _env(tmp_path: Path, tmpdir: Path) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmpdir),
            "USER": "u"}


def _published_headers(tmp_path: Path) -> ArtifactPool:
    """A pool holding an inductor tree with a kernel and a precompiled header, as a
    node whose TORCHINDUCTOR_CACHE_DIR is ``tmp_path/cache`` publishes it; the
    publisher's directories are removed again."""
    pool = ArtifactPool(tmp_path / "pool")
    tmp_a = tmp_path / "tmpA"
    pch = tmp_a / "torchinductor_u" / "precompiled_headers"
    pch.mkdir(parents=True)
    (pch / "cpp_prefix.h.gch").write_bytes(HEADER)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "x.so").write_bytes(b"so")
    assert jit.family("inductor", pool=pool, environ=_env(tmp_path, tmp_a)).publish() == 2
    shutil.rmtree(cache)
    shutil.rmtree(tmp_a)
    return pool


def _files(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


@needs_root
def test_headers_are_not_placed_through_a_default_directory_link_another_user_planted(
    tmp_path: Path,
) -> None:
    pool = _published_headers(tmp_path)
    tmp_b = tmp_path / "tmpB"
    tmp_b.mkdir()
    mine = tmp_path / "mine"  # where the link points: a directory of this user's
    mine.mkdir()
    link = tmp_b / "torchinductor_u"
    link.symlink_to(mine)
    os.lchown(link, OTHER_UID, OTHER_UID)
    family = jit.family("inductor", pool=pool, environ=_env(tmp_path, tmp_b))
    with pytest.raises(JitCacheError, match="symbolic link"):
        family.materialize()
    assert _files(mine) == []


@needs_root
def test_headers_are_not_placed_in_another_users_default_directory(tmp_path: Path) -> None:
    pool = _published_headers(tmp_path)
    tmp_c = tmp_path / "tmpC"
    tmp_c.mkdir()
    theirs = tmp_c / "torchinductor_u"
    theirs.mkdir()
    theirs.chmod(0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    family = jit.family("inductor", pool=pool, environ=_env(tmp_path, tmp_c))
    with pytest.raises(JitCacheError, match="belongs to uid"):
        family.materialize()
    assert _files(theirs) == []
    family.install(pool, None)  # at start-up: logged, nothing written
    assert family.report.refused is not None and "belongs to uid" in family.report.refused
    assert _files(theirs) == []


def test_a_directory_every_user_may_change_on_the_way_is_refused_unless_sticky(
    tmp_path: Path,
) -> None:
    pool = _published_headers(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may rename or replace what is in it
    family = jit.family("inductor", pool=pool, environ=_env(tmp_path, shared))
    with pytest.raises(JitCacheError, match="every user"):
        family.materialize()
    assert _files(shared) == []
    assert (tmp_path / "cache" / "x.so").read_bytes() == b"so"  # the other root filled
    shared.chmod(0o1777)  # as /tmp: only an entry's owner may rename or remove it
    placed = family.materialize()
    assert (placed.written, placed.present) == (1, 1)
    header = shared / "torchinductor_u" / "precompiled_headers" / "cpp_prefix.h.gch"
    assert header.read_bytes() == HEADER


def test_the_default_directory_is_created_and_a_link_of_this_user_followed(
    tmp_path: Path,
) -> None:
    pool = _published_headers(tmp_path)
    disk = tmp_path / "disk"
    (disk / "tmp").mkdir(parents=True)
    home = tmp_path / "home"
    home.symlink_to(disk)  # this user's own link on the way (a home on another disk)
    family = jit.family("inductor", pool=pool, environ=_env(tmp_path, home / "tmp"))
    placed = family.materialize()
    assert placed.written == 2
    header = disk / "tmp" / "torchinductor_u" / "precompiled_headers" / "cpp_prefix.h.gch"
    assert header.read_bytes() == HEADER
    assert (tmp_path / "cache" / "x.so").read_bytes() == b"so"


@needs_root
def test_headers_are_not_published_through_a_link_another_user_planted(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "precompiled_headers").mkdir(parents=True)
    (elsewhere / "precompiled_headers" / "secret.gch").write_bytes(b"secret")
    tmp_d = tmp_path / "tmpD"
    tmp_d.mkdir()
    link = tmp_d / "torchinductor_u"
    link.symlink_to(elsewhere)
    os.lchown(link, OTHER_UID, OTHER_UID)
    (tmp_path / "cache").mkdir()
    family = jit.family("inductor", pool=pool, environ=_env(tmp_path, tmp_d))
    with pytest.raises(JitCacheError, match="symbolic link"):
        family.publish()
    assert family.merged().entries == {}


def _long_names_pool(tmp_path: Path, names: list[str]) -> ArtifactPool:
    pool = ArtifactPool(tmp_path / "pool")
    src = tmp_path / "src"
    for name in names:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(b"x" + name.encode())
    assert Family(FamilySpec("deep_gemm", "k", (Root(src),)), pool).publish() == len(names)
    return pool


LONG = "\U0001F600" * 60 + ".so"  # 243 bytes: a legal file name
NAMES = ["a.so", LONG, "\U0001F601later.so", "\U0001F602/sub.so"]


def test_a_legal_name_whose_temporary_name_would_be_too_long_is_placed(tmp_path: Path) -> None:
    assert len(LONG.encode()) <= 255
    pool = _long_names_pool(tmp_path, NAMES)
    dst = tmp_path / "dst"
    placed = Family(FamilySpec("deep_gemm", "k", (Root(dst),)), pool).materialize()
    assert (placed.written, placed.missing) == (len(NAMES), 0)
    for name in NAMES:
        assert (dst / name).read_bytes() == b"x" + name.encode()
    assert not [p for p in dst.rglob("*.distcache.tmp")]


def test_a_file_that_cannot_be_placed_is_counted_logged_once_and_the_rest_placed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _long_names_pool(tmp_path, NAMES)
    dst = tmp_path / "dst"
    real_open = os.open

    def refusing_open(path: str | os.PathLike[str], flags: int, mode: int = 0o777,
                      **kw: object) -> int:
        if "later" in os.fspath(path) and os.fspath(path).endswith(".distcache.tmp"):
            raise OSError(errno.EACCES, "refused by the test", os.fspath(path))
        return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="distcache"):
        placed = Family(FamilySpec("deep_gemm", "k", (Root(dst),)), pool).materialize()
    monkeypatch.undo()
    assert (placed.written, placed.missing) == (len(NAMES) - 1, 1)
    assert not (dst / "\U0001F601later.so").exists()
    for name in ("a.so", LONG, "\U0001F602/sub.so"):
        assert (dst / name).read_bytes() == b"x" + name.encode()
    warned = [r.getMessage() for r in caplog.records if "later.so" in r.getMessage()]
    assert len(warned) == 1 and "refused by the test" in warned[0]


def test_a_full_filesystem_still_stops_the_fill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _long_names_pool(tmp_path, NAMES)
    dst = tmp_path / "dst"
    real_write = os.write

    def full_write(fd: int, data: object) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcache.tmp"):
            raise OSError(errno.ENOSPC, "no space left on device")
        return real_write(fd, data)  # type: ignore[arg-type]

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell a placement's temporary file")
    monkeypatch.setattr(os, "write", full_write)
    with pytest.raises(OSError) as raised:
        Family(FamilySpec("deep_gemm", "k", (Root(dst),)), pool).materialize()
    monkeypatch.undo()
    assert raised.value.errno == errno.ENOSPC
