"""Shared fixtures: a synthetic artifact set on disk and a loopback origin serving it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import Artifact, parse_checksums
from distcache.testing import LoopbackOrigin, make_artifacts

# Small files keep tests fast; the names and the layout are FlashInfer's.
ARTIFACT_COUNT = 8


@pytest.fixture(autouse=True)
def _flush_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests flush in the background at once: a flush held off into the
    next test would run there, under that test's patches (the hold-off has tests of
    its own in test_pool_batch)."""
    from distcache.store._durability import Durability

    monkeypatch.setattr(Durability, "flush_delay", 0.0)


@pytest.fixture
def artifact_dir(tmp_path: Path) -> Path:
    """A directory holding ARTIFACT_COUNT artifacts and their checksums.txt."""
    root = tmp_path / "origin"
    make_artifacts(root, ARTIFACT_COUNT, min_size=2_000, max_size=150_000, seed=1)
    return root


@pytest.fixture
def artifacts(artifact_dir: Path) -> list[Artifact]:
    """The artifacts in ``artifact_dir``, with their sizes."""
    listed = parse_checksums((artifact_dir / "checksums.txt").read_text())
    return [Artifact(a.name, a.sha256, (artifact_dir / a.name).stat().st_size) for a in listed]


@pytest.fixture
def origin_server(artifact_dir: Path) -> Iterator[LoopbackOrigin]:
    """A LoopbackOrigin serving ``artifact_dir``; stopped after the test."""
    with LoopbackOrigin(artifact_dir) as server:
        yield server
