"""The loader wrapper where FlashInfer's own loader answers differently from a pool:
``FLASHINFER_CUBIN_CHECKSUM_DISABLED``, names the pool cannot store, bytes that fail
the sha256 at FlashInfer's own repository, and what the counters say under contention."""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.integrations.flashinfer import _download
from distcache.integrations.flashinfer._download import RoutedDownload
from distcache.integrations.flashinfer._loader import PooledLoader
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool

UPSTREAM = b"// header as published\n" * 20
HEADER = "pin/gemm/include/k.h"
CUBIN = "pin/fmha/trtllm-gen/k.cubin"
LOCAL = b"// header being developed\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def cubin_loader() -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as module
    return module


class Origin:
    """Serves ``files``; counts calls; ``wait`` delays every answer."""

    def __init__(self, files: dict[str, bytes], wait: float = 0.0) -> None:
        self.files, self.wait = files, wait
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "test://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        with self._lock:
            self.calls.append(artifact.name)
        time.sleep(self.wait)
        return self.files[artifact.name]


class FlashInfer:
    """Stands in for FlashInfer's ``get_artifact``: records calls, answers ``answer``."""

    def __init__(self, answer: bytes = b"flashinfer's answer") -> None:
        self.answer = answer
        self.calls: list[tuple[Any, Any]] = []

    def __call__(self, file_name: Any, sha256: Any, session: Any = None) -> bytes:
        self.calls.append((file_name, sha256))
        return self.answer


# -- FLASHINFER_CUBIN_CHECKSUM_DISABLED -------------------------------------------------


@pytest.mark.parametrize("name", [HEADER, CUBIN])
def test_checksum_disabled_serves_the_local_file_and_never_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cubin_loader: ModuleType, name: str
) -> None:
    cubins = tmp_path / "cubins"
    local = cubins / name
    local.parent.mkdir(parents=True)
    local.write_bytes(LOCAL)
    monkeypatch.setattr(cubin_loader, "FLASHINFER_CUBIN_DIR", cubins)
    monkeypatch.setenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", "1")
    origin = Origin({name: UPSTREAM})
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), cubin_loader.get_artifact,
                          origin=origin, cubin_dir=lambda: cubins)  # type: ignore[arg-type]
    # FlashInfer's own answer: the local file, whatever its sha256.
    assert cubin_loader.get_artifact(name, sha(UPSTREAM)) == LOCAL
    assert loader(name, sha(UPSTREAM)) == LOCAL
    assert local.read_bytes() == LOCAL
    assert origin.calls == [] and loader.stats.passthrough == 1


def test_checksum_disabled_hands_direct_downloads_to_flashinfer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_download, "loader_attr", lambda attr: "https://repo.example/")
    monkeypatch.setattr(_download, "pinned_digest", lambda name: sha(UPSTREAM))
    monkeypatch.setenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", "1")
    flashinfer = FlashInfer()
    downloads: list[tuple[Any, Any]] = []
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), flashinfer,
                          origin=Origin({HEADER: UPSTREAM}))  # type: ignore[arg-type]
    routed = RoutedDownload(loader, lambda s, d, *a, **k: downloads.append((s, d)) or True,
                            offline=False)
    target = tmp_path / "k.h"
    assert routed("https://repo.example/" + HEADER, str(target)) is True
    assert downloads == [("https://repo.example/" + HEADER, str(target))]
    assert routed.routed == 0 and flashinfer.calls == [] and not target.exists()


# -- names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pin/./k.cubin", "pin//./k.cubin", "a\\b.cubin", "a\x00b", "",
                                  "x" * 2000 + ".cubin", 42])
def test_names_the_pool_cannot_store_go_to_flashinfer(tmp_path: Path, name: Any) -> None:
    flashinfer = FlashInfer()
    origin = Origin({})
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), flashinfer,
                          origin=origin)  # type: ignore[arg-type]
    assert loader(name, sha(UPSTREAM)) == b"flashinfer's answer"
    assert flashinfer.calls == [(name, sha(UPSTREAM))] and origin.calls == []
    assert (loader.stats.passthrough, loader.stats.rejected) == (1, 0)


@pytest.mark.parametrize("name", ["../k.cubin", "pin/../../k.cubin", "/etc/passwd",
                                  Path("/etc/passwd"), "pin/.."])
def test_names_that_could_leave_the_directory_answer_empty(tmp_path: Path, name: Any) -> None:
    flashinfer = FlashInfer()
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), flashinfer,
                          origin=Origin({}))  # type: ignore[arg-type]
    assert loader(name, sha(UPSTREAM)) == b""
    assert flashinfer.calls == [] and loader.stats.rejected == 1


# -- bytes that fail the sha256 ---------------------------------------------------------


@pytest.mark.parametrize("own_repository", [True, False])
def test_a_mismatch_at_flashinfers_repository_is_final(
    tmp_path: Path, own_repository: bool
) -> None:
    mirror = tmp_path / "mirror" / "pin" / "fmha" / "trtllm-gen"
    mirror.mkdir(parents=True)
    (mirror / "k.cubin").write_bytes(b"not the kernel")
    flashinfer = FlashInfer()
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), flashinfer,
                          origin=DirOrigin(tmp_path / "mirror"), final_not_found=own_repository)
    answer = loader(CUBIN, sha(UPSTREAM))
    if own_repository:
        # FlashInfer would download the same bytes and reject them: its answer is b"".
        assert answer == b"" and flashinfer.calls == []
        assert (loader.stats.mismatched, loader.stats.fallbacks) == (1, 0)
    else:
        assert answer == b"flashinfer's answer" and len(flashinfer.calls) == 1
        assert (loader.stats.mismatched, loader.stats.fallbacks) == (0, 1)


# -- counters ---------------------------------------------------------------------------


def test_callers_that_waited_for_another_download_count_as_hits(tmp_path: Path) -> None:
    origin = Origin({CUBIN: UPSTREAM}, wait=0.2)
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), FlashInfer(),
                          origin=origin)  # type: ignore[arg-type]
    start = threading.Barrier(8)
    answers: list[bytes] = []

    def ask() -> None:
        start.wait()
        answers.append(loader(CUBIN, sha(UPSTREAM)))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [UPSTREAM] * 8 and origin.calls == [CUBIN]
    assert (loader.stats.fetched, loader.stats.hits) == (1, 7)
