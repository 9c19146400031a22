"""Which files in FlashInfer's cubin directory the wrapper leaves in place.

FlashInfer opens some of its files by path (a CuTe-DSL ``.so``, a header, a
``checksums.txt``), so a file left there must stay what it was checked to be: only
this user's regular file, reached without a symlink, is kept; another user's file or
one behind a symlinked directory is replaced or refused, as the pool's materialize
does. Also: an offline miss through ``download_file`` logs one error line, not two.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from distcache.integrations import flashinfer as fi
from distcache.store import ArtifactPool

SO = b"\x7fELF-cute-dsl" * 100
SO_NAME = "pin/fmha/cute-dsl/x86_64/sm_100a/k.so"
MANIFEST = b"1111111111111111111111111111111111111111111111111111111111111111  k.so\n"
MANIFEST_NAME = "pin/fmha/cute-dsl/x86_64/sm_100a/checksums.txt"
#: A user other than this process's (``nobody`` on most systems).
OTHER = 65534

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="giving a file to another user (os.chown) needs root")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def flashinfer_says_nothing(*_args: Any) -> bytes:
    return b""


def _flashinfer(name: str) -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return __import__(name, fromlist=["_"])


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DISTCACHE_ORIGIN", "DISTCACHE_OFFLINE", "FLASHINFER_NO_DOWNLOAD",
                "FLASHINFER_CUBIN_CHECKSUM_DISABLED", "DISTCACHE_DISABLE",
                "DISTCACHE_FLASHINFER", "DISTCACHE_FLASHINFER_FAMILIES"):
        monkeypatch.delenv(var, raising=False)


def _loader(tmp_path: Path, *, pooled: bool) -> tuple[fi.PooledLoader, Path]:
    """A wrapper over a fresh pool (holding ``SO`` when ``pooled``) and its cubin dir."""
    pool = ArtifactPool(tmp_path / "pool")
    if pooled:
        pool.put(SO, sha(SO))
    cubins = tmp_path / "cubins"
    loader = fi.PooledLoader(pool, flashinfer_says_nothing, cubin_dir=lambda: cubins)
    return loader, cubins


# --- get_artifact: the file FlashInfer opens by path ----------------------------------


@needs_root
@pytest.mark.parametrize("pooled", [True, False], ids=["pool-holds-it", "pool-empty"])
def test_another_users_file_with_the_right_bytes_is_replaced_by_this_users(
        tmp_path: Path, pooled: bool) -> None:
    loader, cubins = _loader(tmp_path, pooled=pooled)
    theirs = cubins / SO_NAME
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(SO)  # the right bytes today; its owner may rewrite them tomorrow
    os.chown(theirs, OTHER, OTHER)
    planted = os.stat(theirs).st_ino
    assert loader(SO_NAME, sha(SO)) == SO
    st = os.lstat(cubins / SO_NAME)
    assert st.st_uid == os.geteuid()
    assert st.st_ino != planted
    assert (cubins / SO_NAME).read_bytes() == SO


@pytest.mark.parametrize("pooled", [True, False], ids=["pool-holds-it", "pool-empty"])
def test_a_symlinked_directory_in_the_cubin_dir_is_not_trusted_nor_written_through(
        tmp_path: Path, pooled: bool) -> None:
    loader, cubins = _loader(tmp_path, pooled=pooled)
    elsewhere = tmp_path / "other_users_dir"
    (elsewhere / "sm_100a").mkdir(parents=True)
    (elsewhere / "sm_100a" / "k.so").write_bytes(SO)  # the right bytes, behind a link
    planted = os.stat(elsewhere / "sm_100a" / "k.so").st_ino
    (cubins / "pin/fmha/cute-dsl").mkdir(parents=True)
    os.symlink(elsewhere, cubins / "pin/fmha/cute-dsl/x86_64")
    assert loader(SO_NAME, sha(SO)) == SO  # served all the same
    # The wrapper tried to place its own file, and refused to write through the link.
    assert "symlink" in loader.stats.failures[SO_NAME]
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["k.so", "sm_100a"]
    assert os.stat(elsewhere / "sm_100a" / "k.so").st_ino == planted


@pytest.mark.parametrize("pooled", [True, False], ids=["pool-holds-it", "pool-empty"])
def test_this_users_own_file_with_the_right_bytes_is_kept(tmp_path: Path, pooled: bool) -> None:
    loader, cubins = _loader(tmp_path, pooled=pooled)
    mine = cubins / SO_NAME
    mine.parent.mkdir(parents=True)
    mine.write_bytes(SO)
    kept = os.stat(mine).st_ino
    assert loader(SO_NAME, sha(SO)) == SO
    assert os.stat(mine).st_ino == kept  # not rewritten: a reader keeps its inode
    assert loader.stats.failures == {}


# --- download_file: a pinned file served by the pool ---------------------------------


@pytest.fixture
def routed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """FlashInfer's ``cubin_loader`` with ``MANIFEST_NAME`` pinned, its cubin directory
    under ``tmp_path``; the wrapper is uninstalled afterwards."""
    loader_module = _flashinfer("flashinfer.jit.cubin_loader")
    artifacts_module = _flashinfer("flashinfer.artifacts")
    env_module = _flashinfer("flashinfer.jit.env")
    monkeypatch.setitem(artifacts_module.CheckSumHash.map_checksums, MANIFEST_NAME,
                        sha(MANIFEST))
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBINS_REPOSITORY",
                        "http://127.0.0.1:9/cubins/")  # never reached in these tests
    for module in (loader_module, env_module):
        monkeypatch.setattr(module, "FLASHINFER_CUBIN_DIR", tmp_path / "cubins")
    try:
        yield loader_module
    finally:
        fi.uninstall()


@needs_root
def test_download_file_replaces_another_users_file_with_the_right_bytes(
        tmp_path: Path, routed: ModuleType) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(MANIFEST, sha(MANIFEST))
    fi.install(pool)
    theirs = tmp_path / "downloads" / "checksums.txt"
    theirs.parent.mkdir()
    theirs.write_bytes(MANIFEST)
    os.chown(theirs, OTHER, OTHER)
    planted = os.stat(theirs).st_ino
    source = routed.FLASHINFER_CUBINS_REPOSITORY + MANIFEST_NAME
    assert routed.download_file(source, str(theirs)) is True
    st = os.lstat(theirs)
    assert (st.st_uid, theirs.read_bytes()) == (os.geteuid(), MANIFEST)
    assert st.st_ino != planted


def test_an_offline_miss_through_download_file_logs_one_error_line(
        tmp_path: Path, routed: ModuleType, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    fi.install(ArtifactPool(tmp_path / "pool"))
    source = routed.FLASHINFER_CUBINS_REPOSITORY + MANIFEST_NAME
    with caplog.at_level(logging.DEBUG):
        assert routed.download_file(source, str(tmp_path / "checksums.txt")) is False
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert MANIFEST_NAME in errors[0] and "distcache fetch" in errors[0]
    assert not (tmp_path / "checksums.txt").exists()


@needs_root
def test_a_right_file_in_another_users_directory_is_kept_when_it_cannot_be_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from distcache.integrations.flashinfer._download import _write

    cubins = tmp_path / "cubins"
    theirs = cubins / "pin" / "checksums.txt"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(MANIFEST)
    os.chown(theirs, OTHER, OTHER)
    os.chown(theirs.parent, OTHER, OTHER)  # a directory this user may not write through
    with caplog.at_level(logging.WARNING):
        # The right bytes: kept (the whole directory is theirs), with a warning.
        assert _write(theirs, MANIFEST, cubins) is True
        assert any("kept" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING)
        # Other bytes there cannot be replaced either: the download fails.
        assert _write(theirs, SO, cubins) is False
    assert theirs.read_bytes() == MANIFEST and os.lstat(theirs).st_uid == OTHER
