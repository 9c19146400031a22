"""The FlashInfer integration in directories others can write to: a cubin directory
shared by several users, a usage record cut short or appended to, and an uninstall
while a load is still in flight."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.errors import PoolError
from distcache.integrations import flashinfer as fi
from distcache.integrations.flashinfer._record import Recorder, read_record
from distcache.store import ArtifactPool
from distcache.store._fs import process_umask

HEADER = b"// header\n" * 50
HEADER_NAME = "pin/gemm/include/flashinferMetaInfo.h"
SO = b"\x7fELF-cute-dsl" * 100
SO_NAME = "pin/fmha/cute-dsl/x86_64/sm_100a/k.so"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DISTCACHE_ORIGIN", "DISTCACHE_OFFLINE", "FLASHINFER_NO_DOWNLOAD",
                "FLASHINFER_CUBIN_CHECKSUM_DISABLED", "DISTCACHE_DISABLE",
                "DISTCACHE_FLASHINFER"):
        monkeypatch.delenv(var, raising=False)


class Origin:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def describe(self) -> str:
        return "test://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        return self.files[artifact.name]


class UnwritablePool:
    """A pool that refuses every publication, after the download: the loader then
    writes the verified bytes into the cubin directory itself."""

    root = "unwritable"

    def get(self, digest: str, *, trust_own: bool = False) -> bytes | None:
        return None

    def has(self, digest: str) -> bool:
        return False

    def put(self, data: bytes, sha256: str | None = None) -> str:
        raise PoolError("cannot publish: Permission denied", path="objects")

    def fetch(self, artifact: Artifact, origin: Any) -> bytes:
        origin.fetch(artifact)
        raise PoolError("cannot publish: Permission denied", path="objects")

    def materialize(self, artifact: Artifact, into_dir: Path) -> Path:
        raise PoolError("not in the pool", path="objects")


def flashinfer_says_nothing(*_args: Any) -> bytes:
    return b""


def header_loader(cubins: Path) -> fi.PooledLoader:
    return fi.PooledLoader(UnwritablePool(), flashinfer_says_nothing,  # type: ignore[arg-type]
                           origin=Origin({HEADER_NAME: HEADER}),  # type: ignore[arg-type]
                           cubin_dir=lambda: cubins)


# --- the fallback write into FLASHINFER_CUBIN_DIR ---------------------------------------


def test_fallback_write_refuses_a_symlinked_directory(tmp_path: Path) -> None:
    cubins, elsewhere = tmp_path / "cubins", tmp_path / "other_users_dir"
    cubins.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, cubins / "pin")  # planted by another user
    loader = header_loader(cubins)
    assert loader(HEADER_NAME, sha(HEADER)) == HEADER  # served all the same
    assert list(elsewhere.rglob("*")) == []
    assert "symlink" in loader.stats.failures[HEADER_NAME]
    assert loader.stats.fallbacks == 0


def test_fallback_write_gives_flashinfers_file_mode(tmp_path: Path) -> None:
    cubins = tmp_path / "cubins"
    cubins.mkdir()
    assert header_loader(cubins)(HEADER_NAME, sha(HEADER)) == HEADER
    written = cubins / HEADER_NAME
    assert written.read_bytes() == HEADER
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~process_umask()


# --- the usage record ------------------------------------------------------------------


def test_a_record_appended_after_a_torn_line_is_still_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record = tmp_path / "rec"
    record.mkdir()
    # The last run under this file name died in the middle of a line.
    (record / "h-7.txt").write_text(f"{sha(b'a')}  pin/a.cubin\n{sha(b'b')[:40]}")
    recorder = Recorder(record, "h-7.txt")
    assert recorder.add("pin/b.cubin", sha(b"b"))
    recorder.close()
    assert (record / "h-7.txt").read_text().endswith(f"\n{sha(b'b')}  pin/b.cubin\n")
    with caplog.at_level(logging.WARNING):
        assert read_record(record) == {"pin/a.cubin": sha(b"a"), "pin/b.cubin": sha(b"b")}
    torn = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    assert len(torn) == 1 and "h-7.txt" in torn[0] and "1 line" in torn[0]


# --- uninstall while a load is in flight -----------------------------------------------


def test_an_installed_cubin_directory_is_never_written(tmp_path: Path) -> None:
    installed = tmp_path / "venv/lib/python3.11/site-packages/flashinfer_cubin/cubins"
    installed.mkdir(parents=True)
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(HEADER, sha(HEADER))
    # What an in-flight load sees after uninstall() put the installed directory back.
    loader = fi.PooledLoader(pool, flashinfer_says_nothing, cubin_dir=lambda: installed)
    assert loader(HEADER_NAME, sha(HEADER)) == HEADER
    assert [p for p in installed.rglob("*") if not p.is_dir()] == []


def test_a_record_is_not_reopened_after_uninstall(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader  # noqa: F401
    loader = fi.install(ArtifactPool(tmp_path / "pool"), record=tmp_path / "rec")
    assert loader is not None and loader.recorder is not None
    fi.uninstall()
    # A load that was in flight records what it served after the uninstall.
    assert not loader.recorder.add("pin/a.cubin", sha(b"a"))
    assert loader.recorder._fd is None
    assert not (tmp_path / "rec").exists() or list((tmp_path / "rec").glob("*.txt")) == []


# --- a symlink at a materialised name ----------------------------------------------------


def test_a_symlink_at_a_materialised_name_is_replaced(tmp_path: Path) -> None:
    cubins = tmp_path / "cubins"
    (cubins / SO_NAME).parent.mkdir(parents=True)
    theirs = tmp_path / "other_user" / "k.so"
    theirs.parent.mkdir()
    theirs.write_bytes(SO)  # the right bytes today; its owner may change them tomorrow
    os.symlink(theirs, cubins / SO_NAME)
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(SO, sha(SO))
    loader = fi.PooledLoader(pool, flashinfer_says_nothing, cubin_dir=lambda: cubins)
    assert loader(SO_NAME, sha(SO)) == SO
    placed = cubins / SO_NAME
    assert not placed.is_symlink() and placed.read_bytes() == SO
