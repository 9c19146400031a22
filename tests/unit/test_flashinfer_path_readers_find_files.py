"""FlashInfer code that asks for a file and then opens it by path finds what it was given.

FlashInfer's deep-gemm kernel map (``KernelMap.init_indices``) calls
``get_artifact(name, sha256)`` and then opens ``FLASHINFER_CUBIN_DIR / name``. With an
installed ``flashinfer-cubin`` (a site-packages directory) the install moves that
directory to FlashInfer's writable cache. Whatever the wrapper answers with (the pool's
bytes, the installed file, FlashInfer's own loader) must then be the file at that path,
not a missing file nor an older one left in the cache by an earlier run. With
``FLASHINFER_CUBIN_CHECKSUM_DISABLED`` set at install nothing is moved at all.

These tests go through the real wrapper and FlashInfer's real deep-gemm module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from distcache.integrations import flashinfer as fi
from distcache.store import ArtifactPool
from tests.support.helpers import clear_settings

INSTALLED = b'{"installed": 1}'
STALE = b'{"from an earlier run": 1}'


def _flashinfer(name: str) -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return __import__(name, fromlist=["_"])


@dataclass
class Site:
    """FlashInfer as a fresh process sees it with ``flashinfer-cubin`` installed."""

    loader_module: ModuleType
    env_module: ModuleType
    deep_gemm: ModuleType
    pool: ArtifactPool
    #: The installed flashinfer-cubin directory (read-only to distcache).
    installed: Path
    #: FlashInfer's own writable cache directory under ``$HOME``.
    cache: Path
    #: The deep-gemm kernel map's name, as FlashInfer builds it (with its ``//``).
    name: str

    def path(self) -> Path:
        """The file FlashInfer opens after asking for ``name``, as it computes it."""
        return Path(self.env_module.FLASHINFER_CUBIN_DIR) / self.name

    def kernel_map(self) -> object:
        """FlashInfer's own path reader: asks for the kernel map, then opens the file."""
        kernel_map = self.deep_gemm.KernelMap()
        kernel_map.init_indices()
        return kernel_map.indice

    def plant(self, root: Path, data: bytes) -> Path:
        path = root / self.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    loader_module = _flashinfer("flashinfer.jit.cubin_loader")
    env_module = _flashinfer("flashinfer.jit.env")
    deep_gemm = _flashinfer("flashinfer.deep_gemm")
    clear_settings(monkeypatch)
    monkeypatch.delenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", raising=False)
    monkeypatch.setenv("FLASHINFER_NO_DOWNLOAD", "1")  # nothing here may be downloaded
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(env_module, "FLASHINFER_CACHE_DIR", home / ".cache" / "flashinfer")
    installed = tmp_path / "venv/lib/python3.11/site-packages/flashinfer_cubin/cubins"
    installed.mkdir(parents=True)
    for module in (loader_module, env_module, deep_gemm):
        monkeypatch.setattr(module, "FLASHINFER_CUBIN_DIR", installed)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBINS_REPOSITORY",
                        "http://127.0.0.1:9/cubins/")  # never reached
    name = deep_gemm.get_deepgemm_artifact_path() + "/" + "kernel_map.json"
    try:
        yield Site(loader_module, env_module, deep_gemm, ArtifactPool(tmp_path / "pool"),
                   installed, home / ".cache" / "flashinfer" / "cubins", name)
    finally:
        fi.uninstall()


def _pin_kernel_map(site: Site, monkeypatch: pytest.MonkeyPatch, data: bytes) -> str:
    """FlashInfer's pinned sha256 of the kernel map, set to ``data``'s."""
    digest = hashlib.sha256(data).hexdigest()
    monkeypatch.setattr(site.deep_gemm.KernelMap, "KERNEL_MAP_HASH", digest)
    return digest


# --- (A) FLASHINFER_CUBIN_CHECKSUM_DISABLED -------------------------------------------


def test_checksums_disabled_at_install_leave_flashinfers_directory_where_it_is(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    site.plant(site.installed, INSTALLED)
    stale = site.plant(site.cache, STALE)
    monkeypatch.setenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", "1")
    loader = fi.install(site.pool)
    assert loader is not None
    assert site.kernel_map() == json.loads(INSTALLED)  # not the older file in the cache
    assert site.path().read_bytes() == INSTALLED
    # As if distcache were absent: FlashInfer reads its installed directory.
    assert site.installed == site.env_module.FLASHINFER_CUBIN_DIR
    assert site.installed == site.deep_gemm.FLASHINFER_CUBIN_DIR
    assert loader.stats.passthrough == 1
    assert stale.read_bytes() == STALE  # nothing of the cache was read or written


def test_checksums_disabled_after_install_keep_the_returned_file_at_the_path(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    site.plant(site.installed, INSTALLED)
    site.plant(site.cache, STALE)
    fi.install(site.pool)
    assert site.cache == site.env_module.FLASHINFER_CUBIN_DIR  # moved at install
    monkeypatch.setenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", "1")
    data = site.loader_module.get_artifact(site.name, "0" * 64)
    assert data == INSTALLED  # what FlashInfer alone would return: the installed file
    assert site.path().read_bytes() == data  # not the older file in the cache
    assert site.kernel_map() == json.loads(INSTALLED)
    assert _tree(site.installed) == {os.path.normpath(site.name): INSTALLED}


# --- (B) a name outside DISTCACHE_FLASHINFER_FAMILIES ---------------------------------


@pytest.mark.parametrize("stale", [False, True], ids=["cache-empty", "older-file-in-cache"])
def test_a_name_outside_the_pooled_families_is_found_at_the_path(
        site: Site, monkeypatch: pytest.MonkeyPatch, stale: bool) -> None:
    monkeypatch.setenv("DISTCACHE_FLASHINFER_FAMILIES", "*.cubin")
    digest = _pin_kernel_map(site, monkeypatch, INSTALLED)
    site.plant(site.installed, INSTALLED)
    if stale:
        site.plant(site.cache, STALE)
    loader = fi.install(site.pool)
    assert loader is not None
    assert site.kernel_map() == json.loads(INSTALLED)
    assert site.path().read_bytes() == INSTALLED
    assert loader.stats.passthrough == 1 and not site.pool.has(digest)
    # A file that already holds exactly the bytes is left in place, not rewritten.
    inode = site.path().stat().st_ino
    assert site.loader_module.get_artifact(site.name, digest) == INSTALLED
    assert site.path().stat().st_ino == inode
    assert _tree(site.installed) == {os.path.normpath(site.name): INSTALLED}


def test_a_file_that_cannot_be_written_is_a_warning_and_the_bytes_are_served(
        site: Site, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DISTCACHE_FLASHINFER_FAMILIES", "*.cubin")
    digest = _pin_kernel_map(site, monkeypatch, INSTALLED)
    site.plant(site.installed, INSTALLED)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    site.cache.mkdir(parents=True)
    # A symlink planted below the cache directory: never written through.
    (site.cache / site.name.split("/")[0]).symlink_to(elsewhere)
    fi.install(site.pool)
    with caplog.at_level(logging.WARNING):
        assert site.loader_module.get_artifact(site.name, digest) == INSTALLED
    assert any("not written under FLASHINFER_CUBIN_DIR" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert list(elsewhere.iterdir()) == []


# --- (C) a pooled name, as before -----------------------------------------------------


def test_a_pooled_name_is_served_from_the_pool_and_placed_at_the_path(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    pooled = b'{"pooled": 1}'
    digest = _pin_kernel_map(site, monkeypatch, pooled)
    site.pool.put(pooled, digest)
    site.plant(site.cache, STALE)
    loader = fi.install(site.pool)
    assert loader is not None
    assert site.kernel_map() == json.loads(pooled)
    assert site.path().read_bytes() == pooled
    assert (loader.stats.hits, loader.stats.passthrough) == (1, 0)
    assert _tree(site.installed) == {}
