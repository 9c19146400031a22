"""FlashInfer's CuTe-DSL FMHA loader fetches its ``checksums.txt`` with
``download_file``, not ``get_artifact``: with the wrapper installed that download is
served by the pool too, and offline it makes no request.

``flashinfer.attention.cute_dsl.fmha._get_checksums`` is the function that reaches
``download_file``; it runs without a GPU (only choosing the architecture and loading
the kernel need one), so it is called here as FlashInfer calls it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from distcache.integrations import flashinfer as fi
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin

ARCH = "sm_100a"
VARIANTS = {
    "cute_dsl_fmha_bf16_h128_causal_persistent": "1" * 64,
    "cute_dsl_fmha_fp16_h64_nocausal_persistent_varlen": "2" * 64,
}


def _flashinfer(name: str) -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return __import__(name, fromlist=["_"])


@pytest.fixture(scope="module")
def fmha() -> ModuleType:
    return _flashinfer("flashinfer.attention.cute_dsl.fmha")


@dataclass
class World:
    fmha: ModuleType
    loader_module: ModuleType
    env_module: ModuleType
    artifacts_module: ModuleType
    origin: LoopbackOrigin
    pool: ArtifactPool
    name: str
    text: bytes
    sha256: str
    tmp: Path

    def use_cubin_dir(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A fresh process's view: FlashInfer's cache directory and its in-memory
        cache of parsed manifests."""
        monkeypatch.setattr(self.loader_module, "FLASHINFER_CUBIN_DIR", path)
        monkeypatch.setattr(self.env_module, "FLASHINFER_CUBIN_DIR", path)
        monkeypatch.setattr(self.fmha, "_checksums_cache", {})


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmha: ModuleType) -> Any:
    loader_module = _flashinfer("flashinfer.jit.cubin_loader")
    env_module = _flashinfer("flashinfer.jit.env")
    artifacts_module = _flashinfer("flashinfer.artifacts")
    for var in ("DISTCACHE_ORIGIN", "DISTCACHE_OFFLINE", "FLASHINFER_NO_DOWNLOAD",
                "DISTCACHE_DISABLE", "DISTCACHE_FLASHINFER", "DISTCACHE_FLASHINFER_FAMILIES"):
        monkeypatch.delenv(var, raising=False)
    # The path FlashInfer computes, and a manifest in the format it parses.
    name = os.path.join(fmha.DSL_FMHA_ARTIFACT_PATH, fmha._get_cpu_arch(), ARCH, "checksums.txt")
    text = "".join(f"{sha}  {variant}.so\n" for variant, sha in VARIANTS.items()).encode()
    sha256 = hashlib.sha256(text).hexdigest()
    (tmp_path / "origin" / name).parent.mkdir(parents=True)
    (tmp_path / "origin" / name).write_bytes(text)
    # FlashInfer pins each manifest's sha256; this one is pinned to the test's bytes.
    monkeypatch.setitem(artifacts_module.CheckSumHash.map_checksums, name, sha256)
    with LoopbackOrigin(tmp_path / "origin") as origin:
        monkeypatch.setattr(loader_module, "FLASHINFER_CUBINS_REPOSITORY", origin.url)
        w = World(fmha, loader_module, env_module, artifacts_module, origin,
                  ArtifactPool(tmp_path / "pool"), name, text, sha256, tmp_path)
        w.use_cubin_dir(tmp_path / "cubins", monkeypatch)
        try:
            yield w
        finally:
            fi.uninstall()


def test_offline_the_cute_dsl_manifest_download_makes_no_request(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    monkeypatch.setenv("DISTCACHE_ORIGIN", world.origin.url)  # configured, yet not asked
    fi.install(world.pool)
    with caplog.at_level(logging.ERROR), pytest.raises(FileNotFoundError):
        world.fmha._get_checksums(ARCH)  # FlashInfer opens the file it could not fetch
    assert world.origin.total_requests == 0
    line = next(r.getMessage() for r in caplog.records if "DISTCACHE_OFFLINE" in r.getMessage())
    assert world.name in line and world.sha256 in line and "distcache fetch" in line, line


def test_offline_the_cute_dsl_manifest_is_served_from_the_pool(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.pool.put(world.text, world.sha256)
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    fi.install(world.pool)
    assert world.fmha._get_checksums(ARCH) == VARIANTS
    assert world.origin.total_requests == 0
    assert (world.tmp / "cubins" / world.name).read_bytes() == world.text


def test_the_cute_dsl_manifest_is_downloaded_once_per_pool(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = fi.install(world.pool)
    assert loader is not None
    assert world.fmha._get_checksums(ARCH) == VARIANTS
    assert world.origin.requests[world.name] == 1
    assert world.pool.get(world.sha256) == world.text
    # Other processes on the pool, each with its own FlashInfer cache: no request.
    for n in range(2):
        world.use_cubin_dir(world.tmp / f"cubins-{n}", monkeypatch)
        assert world.fmha._get_checksums(ARCH) == VARIANTS
        assert (world.tmp / f"cubins-{n}" / world.name).read_bytes() == world.text
    assert world.origin.total_requests == 1
    assert (loader.stats.fetched, loader.stats.hits) == (1, 2)


def test_a_file_flashinfer_pins_no_sha256_for_goes_to_its_own_download_unless_offline(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (world.tmp / "origin" / "other.txt").write_bytes(b"unpinned")
    source = f"{world.origin.url}/other.txt"
    fi.install(world.pool)
    assert world.loader_module.download_file(source, str(world.tmp / "a.txt")) is True
    assert (world.tmp / "a.txt").read_bytes() == b"unpinned"
    assert world.origin.total_requests == 1
    fi.uninstall()
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    fi.install(world.pool)
    with caplog.at_level(logging.ERROR):
        assert world.loader_module.download_file(source, str(world.tmp / "b.txt")) is False
    assert world.origin.total_requests == 1
    assert not (world.tmp / "b.txt").exists()
    assert any(source in r.getMessage() and "DISTCACHE_OFFLINE" in r.getMessage()
               for r in caplog.records)


def test_uninstall_gives_flashinfer_its_download_file_back(world: World) -> None:
    original = world.loader_module.download_file
    assert world.artifacts_module.download_file is original
    fi.install(world.pool)
    assert world.loader_module.download_file is not original
    assert world.artifacts_module.download_file is not original
    fi.uninstall()
    assert world.loader_module.download_file is original
    assert world.artifacts_module.download_file is original
    # FlashInfer's own behaviour again: it downloads, the pool is not involved.
    assert world.fmha._get_checksums(ARCH) == VARIANTS
    assert world.origin.total_requests == 1
    assert world.pool.get(world.sha256) is None
