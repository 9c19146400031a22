"""An archive of a pool's directory is refused by ``pool import``, as the directory is.

``tar -C pool -cf x.tar .`` (or ``tar -cf x.tar pool``) of a pool imported the pool's
own files (``format``, ``names.log``, ``objects/<xx>/<sha>``) as artifacts and reported
success: the real names were lost, and an offline site then missed every kernel. It is
now refused, naming what to do instead, and nothing is imported; the pool's own export
still imports (the guard).
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.cli import main
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.helpers import clear_settings


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


@pytest.fixture
def pool(tmp_path: Path) -> tuple[Path, list[Artifact]]:
    served = make_artifacts(tmp_path / "origin", 3, min_size=100, max_size=400, seed=3)
    root = tmp_path / "pool"
    assert main(["--pool", str(root), "pool", "import", str(tmp_path / "origin")]) == 0
    return root, served


@pytest.mark.parametrize("top", ["", "pool/"])
def test_an_archive_of_a_pools_directory_is_refused(
    tmp_path: Path, pool: tuple[Path, list[Artifact]], top: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, _served = pool
    archive = tmp_path / "pool.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=top.rstrip("/") or ".")
    target = tmp_path / "target"
    assert main(["--pool", str(target), "pool", "import", str(archive)]) == 1
    said = capsys.readouterr().err
    assert "archive of a distcache pool" in said and "pool export --tar" in said
    assert not (target / "names.log").exists() or ArtifactPool(target).names() == {}


def test_the_pools_own_export_still_imports(
    tmp_path: Path, pool: tuple[Path, list[Artifact]],
) -> None:
    root, served = pool
    archive = tmp_path / "set.tar"
    assert main(["--pool", str(root), "pool", "export", "--tar", str(archive)]) == 0
    target = tmp_path / "target"
    assert main(["--pool", str(target), "pool", "import", str(archive)]) == 0
    imported = ArtifactPool(target)
    assert all(imported.has(a.sha256) for a in served)
