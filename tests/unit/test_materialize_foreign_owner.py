"""Materializing into a directory others can write to (a sticky one, like ``/tmp``)
where another user got there first: their file at the target is never handed back,
their directory on the way is refused, and a directory swapped for a symlink while
the file is placed cannot carry it outside the caller's directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.errors import PoolError
from distcache.store import ArtifactPool

DATA = b"\x7fELF good kernel bytes " * 64
#: A user other than this process's (``nobody`` on most systems).
OTHER = 65534

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user (os.chown) needs root")


def _shared(tmp_path: Path) -> Path:
    """A world-writable sticky directory owned by another user, as ``/tmp`` is."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    if os.geteuid() == 0:
        os.chown(shared, OTHER, OTHER)
    return shared


@needs_root
def test_another_users_file_with_the_right_bytes_is_replaced_by_this_users(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(DATA)
    shared = _shared(tmp_path)
    theirs = shared / "k.so"
    theirs.write_bytes(DATA)
    os.chown(theirs, OTHER, OTHER)
    planted = os.stat(theirs).st_ino
    target = pool.materialize(Artifact("k.so", sha), shared)
    st = os.lstat(target)
    assert st.st_uid == os.geteuid()
    assert st.st_ino != planted
    assert target.read_bytes() == DATA


def test_this_users_file_with_the_right_bytes_is_kept(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(DATA)
    out = tmp_path / "out"
    out.mkdir()
    (out / "k.so").write_bytes(DATA)
    kept = os.stat(out / "k.so").st_ino
    target = pool.materialize(Artifact("k.so", sha), out)
    assert os.stat(target).st_ino == kept


@needs_root
@pytest.mark.parametrize("name", ["sub/k.so", "sub/deep/k.so"])
def test_a_directory_of_another_user_below_the_callers_is_refused(
        tmp_path: Path, name: str) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(DATA)
    shared = _shared(tmp_path)
    (shared / "sub" / "deep").mkdir(parents=True)
    os.chown(shared / "sub", OTHER, OTHER)
    with pytest.raises(PoolError, match="uid") as caught:
        pool.materialize(Artifact(name, sha), shared)
    assert caught.value.path == str(shared / "sub")
    assert sorted(p.name for p in shared.rglob("*")) == ["deep", "sub"]  # nothing written


@needs_root
def test_the_callers_directory_may_belong_to_another_user(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(DATA)
    shared = _shared(tmp_path)
    target = pool.materialize(Artifact("sub/k.so", sha), shared)
    assert target.read_bytes() == DATA
    assert os.lstat(target.parent).st_uid == os.geteuid()


@pytest.mark.parametrize("at", ["link", "replace"])
def test_a_directory_swapped_for_a_symlink_while_placing_is_refused_not_written_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(DATA)
    out, victim = tmp_path / "out", tmp_path / "victim"
    victim.mkdir()
    real = getattr(os, at)
    swapped: list[bool] = []

    def swap_first(*args: Any, **kwargs: Any) -> Any:
        # Whoever can rename entries of ``out/sub`` moves ``deep`` aside and puts a
        # link to a directory of their choice in its place, right before the write.
        if not swapped:
            swapped.append(True)
            os.rename(out / "sub" / "deep", out / "sub" / "deep.old")
            os.symlink(victim, out / "sub" / "deep")
        return real(*args, **kwargs)

    monkeypatch.setattr(os, at, swap_first)
    with pytest.raises(PoolError, match="changed while"):
        pool.materialize(Artifact("sub/deep/k.so", sha), out)
    assert swapped
    assert list(victim.iterdir()) == []


def test_a_symlink_on_the_way_is_still_refused(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(DATA)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "sub")
    with pytest.raises(PoolError, match="symlink"):
        pool.materialize(Artifact("sub/k.so", sha), out)
    assert list(elsewhere.iterdir()) == []
