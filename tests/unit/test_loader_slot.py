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


def test_taking_out_a_wrapper_puts_back_the_one_it_replaced_and_its_offline_switch(
    loader_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The zero-code hook installs first (DISTCACHE_AUTOINSTALL=1); a session's install
    # replaces it, and its close takes that one out: the hook's wrapper serves again,
    # and offline FlashInfer's own loader still may not download.
    import os

    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    monkeypatch.delenv("FLASHINFER_NO_DOWNLOAD", raising=False)
    original = loader_module.get_artifact
    hook_pool, session_pool = ArtifactPool(tmp_path / "hook"), ArtifactPool(tmp_path / "s")
    slot = LoaderSlot()
    try:
        hooks = slot.install(hook_pool)
        assert hooks is not None and os.environ.get("FLASHINFER_NO_DOWNLOAD") == "1"
        sessions = slot.install(session_pool)
        assert sessions is not None and sessions is not hooks
        slot.uninstall_if(sessions)  # the session's close
        back = slot.installed()
        assert back is not None and back.pool is hook_pool
        assert loader_module.get_artifact is back and back.original is original
        assert os.environ.get("FLASHINFER_NO_DOWNLOAD") == "1"
        slot.uninstall_if(sessions)  # again: nothing more is taken out
        assert slot.installed() is back
    finally:
        slot.uninstall()  # all of it: FlashInfer's own loader, downloads allowed again
    assert slot.installed() is None and loader_module.get_artifact is original
    assert "FLASHINFER_NO_DOWNLOAD" not in os.environ


def test_an_uninstalled_wrapper_inside_another_librarys_only_passes_calls_on(
    loader_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    # A library wrapped get_artifact after distcache's install: uninstall cannot take
    # that wrapper out, but what it still calls hands each call to FlashInfer's own
    # function (never the pool), and the warning says so.
    import logging

    asked: list[str] = []

    def flashinfers(name: str, sha256: str, session: Any = None) -> bytes:
        asked.append(name)
        return b"from flashinfer"

    monkeypatch.setattr(loader_module, "get_artifact", flashinfers)
    pool = ArtifactPool(tmp_path / "pool")
    slot = LoaderSlot()
    loader = slot.install(pool)
    assert loader is not None
    inner = loader_module.get_artifact

    def telemetry(name: str, sha256: str, session: Any = None) -> bytes:
        return inner(name, sha256, session)  # type: ignore[no-any-return]

    loader_module.get_artifact = telemetry
    with caplog.at_level(logging.WARNING, logger="distcache"):
        slot.uninstall()
    assert loader_module.get_artifact is telemetry
    assert any("another library" in r.getMessage() for r in caplog.records)
    sha = "a" * 64
    assert loader_module.get_artifact("cubins/x/k.cubin", sha) == b"from flashinfer"
    assert asked == ["cubins/x/k.cubin"]
    assert not any(v for k, v in loader.stats.as_dict().items() if k != "failures")
    assert not any(p.is_file() for p in (tmp_path / "pool" / "objects").rglob("*"))
