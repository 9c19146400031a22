"""The FlashInfer wrapper's slot: the process's one loader, and slots tests make."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.integrations import flashinfer as fi
from distcache.integrations.flashinfer._install import LoaderSlot
from distcache.store import ArtifactPool


@pytest.fixture
def loader_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    for var in ("DISTCACHE_DISABLE", "DISTCACHE_FLASHINFER", "DISTCACHE_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as module
    monkeypatch.setattr(module, "FLASHINFER_CUBIN_DIR", tmp_path / "cubins")
    yield module
    fi.uninstall()


def test_a_slot_of_its_own_installs_and_uninstalls_apart_from_the_process_slot(
    loader_module: Any, tmp_path: Path
) -> None:
    original = loader_module.get_artifact
    pool = ArtifactPool(tmp_path / "pool")
    slot = LoaderSlot()
    loader = slot.install(pool)
    try:
        assert loader is not None and loader_module.get_artifact is loader
        assert slot.installed() is loader and slot.install(pool) is loader
        assert fi.installed() is None  # the process's slot holds nothing
        slot.uninstall_if(object())  # type: ignore[arg-type]
        assert slot.installed() is loader  # only its own wrapper is taken out
    finally:
        slot.uninstall()
    assert slot.installed() is None and loader_module.get_artifact is original
    slot.uninstall()  # idempotent


def test_the_module_functions_use_the_process_slot(loader_module: Any, tmp_path: Path) -> None:
    from distcache.integrations.flashinfer import _install

    original = loader_module.get_artifact
    loader = fi.install(ArtifactPool(tmp_path / "pool"))
    assert loader is not None and _install._PROCESS.installed() is loader
    _install.uninstall_if(loader)
    assert fi.installed() is None and loader_module.get_artifact is original


def test_the_flashinfer_integration_installs_into_the_process_slot(
    loader_module: Any, tmp_path: Path
) -> None:
    integration = fi.FlashInfer(record=tmp_path / "record")
    integration.install(ArtifactPool(tmp_path / "pool"), None)
    loader = fi.installed()
    assert loader is not None and loader.recorder is not None
    integration.uninstall()
    assert fi.installed() is None
