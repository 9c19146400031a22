"""Verified bytes that cannot be written under ``FLASHINFER_CUBIN_DIR`` (a symlinked
pin directory the pool refuses to write through, a directory that cannot be created)
are still served: FlashInfer's own loader is not asked (online it would download them
again, offline it raises although the pool holds them), the failure is logged once per
name and is no fallback."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from distcache.artifact import Artifact, path_under
from distcache.store import ArtifactPool
from tests.unit.test_flashinfer import (
    HEADER,
    HEADER_NAME,
    FakeFlashInfer,
    FakeOrigin,
    UnwritablePool,
    make_loader,
    sha,
)

CHECKSUMS = b"0123abcd" * 8 + b"  fmhaKernel.cubin\n"
CHECKSUMS_NAME = "pin/fmha/trtllm-gen/checksums.txt"
UNWRITTEN = "not written under FLASHINFER_CUBIN_DIR"


def _symlinked_pin(tmp_path: Path) -> Path:
    """A cubin directory whose ``pin`` is a symlink to shared storage (refused)."""
    cubins, shared = tmp_path / "cubins", tmp_path / "shared_pin"
    cubins.mkdir()
    shared.mkdir()
    os.symlink(shared, cubins / "pin")
    return cubins


def _under_a_file(tmp_path: Path) -> Path:
    """A cubin directory that cannot be created: its parent is a regular file."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    return blocker / "cubins"


def _logged(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("cubins_of", [_symlinked_pin, _under_a_file],
                         ids=["symlinked-pin", "uncreatable-dir"])
def test_a_pool_hit_that_cannot_be_materialised_is_served_offline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cubins_of: Callable[[Path], Path]
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(CHECKSUMS, sha(CHECKSUMS))
    pool.remember([Artifact(CHECKSUMS_NAME, sha(CHECKSUMS))])
    cubins = cubins_of(tmp_path)
    # FLASHINFER_NO_DOWNLOAD: FlashInfer's own loader raises "not found locally".
    origin, original = FakeOrigin({}), FakeFlashInfer(raises=True)
    loader = make_loader(pool, cubins, origin, original, offline=True)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        assert loader(CHECKSUMS_NAME, sha(CHECKSUMS)) == CHECKSUMS
        assert loader(CHECKSUMS_NAME, sha(CHECKSUMS)) == CHECKSUMS
    assert original.calls == [] and origin.calls == []
    assert (loader.stats.hits, loader.stats.fallbacks, loader.stats.offline_misses) == (2, 0, 0)
    assert UNWRITTEN in loader.stats.failures[CHECKSUMS_NAME]
    assert _logged(caplog, UNWRITTEN) == 1  # once per name, however many calls
    assert _logged(caplog, "using FlashInfer's own loader") == 0
    assert not path_under(cubins, CHECKSUMS_NAME).exists()  # nor through the link


def test_a_download_neither_the_pool_nor_the_cubin_dir_can_keep_is_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = UnwritablePool(tmp_path / "pool")
    cubins = _under_a_file(tmp_path)
    origin, original = FakeOrigin({HEADER_NAME: HEADER}), FakeFlashInfer()
    loader = make_loader(pool, cubins, origin, original)
    with caplog.at_level(logging.WARNING):
        assert loader(HEADER_NAME, sha(HEADER)) == HEADER
        assert loader(HEADER_NAME, sha(HEADER)) == HEADER
    # Kept nowhere, so each call downloads once through distcache; FlashInfer never.
    assert origin.calls == [HEADER_NAME] * 2 and original.calls == []
    assert (loader.stats.fetched, loader.stats.unpublished, loader.stats.fallbacks) == (2, 2, 0)
    assert _logged(caplog, UNWRITTEN) == 1
    assert _logged(caplog, "cannot take downloads") == 1  # once per pool
    assert not path_under(cubins, HEADER_NAME).exists()
