"""What an export must not do to files that are not its own: write through a link
planted at its temporary name in a shared mirror, remove a file another run left at
that name, or relabel the pool it only reads from."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

import distcache.store._export as export_module
from distcache.artifact import Artifact, parse_checksums, sha256_hex
from distcache.cli import main
from distcache.errors import PoolError
from distcache.store import ArtifactPool, PoolLayout
from distcache.store._export import export_tar
from distcache.testing import make_artifacts
from tests.support.helpers import clear_settings


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


@pytest.fixture
def served(tmp_path: Path) -> list[Artifact]:
    return make_artifacts(tmp_path / "origin", 3, min_size=100, max_size=400, seed=7)


@pytest.fixture
def pool(tmp_path: Path, served: list[Artifact]) -> Path:
    root = tmp_path / "pool"
    assert main(["--pool", str(root), "pool", "import", str(tmp_path / "origin")]) == 0
    return root


def _old_name(path: Path, suffix: str = "") -> Path:
    """The temporary name the export used to take for ``path``: guessable from the pid."""
    return path.with_name(f".{path.name}.{os.getpid()}{suffix}")


def _planted(tmp_path: Path) -> tuple[Path, Path, Path]:
    """An export directory, another user's file, and a link to it planted at the name
    of the manifest's temporary file as it was guessable before."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("another user's file\n")
    planted = _old_name(mirror / "checksums.txt")
    planted.symlink_to(victim)
    return mirror, victim, planted


def _listed(directory: Path) -> set[tuple[str, str]]:
    return {(a.name, a.sha256)
            for a in parse_checksums((directory / "checksums.txt").read_text())}


# --- pool export DIR: the checksums.txt temporary file --------------------------------


def test_export_dir_over_a_planted_link_refuses_and_writes_through_nothing(
    tmp_path: Path, pool: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The export is built beside DIR at a fresh exclusive name and swapped in whole; a
    # DIR holding what no export wrote (here another user's link) is not replaced.
    mirror, victim, planted = _planted(tmp_path)
    capsys.readouterr()
    assert main(["--pool", str(pool), "pool", "export", str(mirror)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"distcache: error: cannot export to {mirror}: ")
    assert victim.read_text() == "another user's file\n"
    assert planted.is_symlink()
    assert list(mirror.iterdir()) == [planted]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mirror")] == []


# --- pool export DIR --manifest M: the source pool is only read -----------------------


def test_export_dir_of_another_manifest_leaves_the_pool_labels_alone(
    tmp_path: Path, pool: Path, served: list[Artifact]
) -> None:
    names_log = PoolLayout(pool).names_log
    before = names_log.read_bytes()
    labels = ArtifactPool(pool).names()
    first, second = served[0], served[1]
    # Another version's manifest: first's name now holds second's bytes, plus a new name.
    manifest = tmp_path / "other.txt"
    manifest.write_text(f"{second.sha256}  {first.name}\n{first.sha256}  renamed/x.cubin\n")
    mirror = tmp_path / "mirror"
    assert main(["--pool", str(pool), "pool", "export", str(mirror),
                 "--manifest", str(manifest)]) == 0
    assert names_log.read_bytes() == before
    assert ArtifactPool(pool).names() == labels
    assert sha256_hex((mirror / first.name).read_bytes()) == second.sha256
    assert sha256_hex((mirror / "renamed/x.cubin").read_bytes()) == first.sha256
    assert _listed(mirror) == {(first.name, second.sha256), ("renamed/x.cubin", first.sha256)}


def test_export_dir_from_a_pool_whose_labels_cannot_be_written(
    tmp_path: Path, pool: Path, served: list[Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Standing in for a names.log on a read-only mount (root ignores file modes).
    def refuse(self: ArtifactPool, artifacts: object) -> None:
        raise PoolError(f"cannot append to {self.layout.names_log}: Read-only file system",
                        path=str(self.layout.names_log))

    monkeypatch.setattr(ArtifactPool, "remember", refuse)
    manifest = tmp_path / "mirror.txt"
    manifest.write_text(f"{served[0].sha256}  mirror/a.cubin\n")
    mirror = tmp_path / "mirror"
    assert main(["--pool", str(pool), "pool", "export", str(mirror),
                 "--manifest", str(manifest)]) == 0
    assert sha256_hex((mirror / "mirror/a.cubin").read_bytes()) == served[0].sha256
    assert _listed(mirror) == {("mirror/a.cubin", served[0].sha256)}


# --- pool export --tar FILE: the tarball's temporary file -----------------------------


def test_export_tar_keeps_a_file_another_run_left_at_a_guessed_name(
    tmp_path: Path, pool: Path, served: list[Artifact]
) -> None:
    target = tmp_path / "set.tar"
    other = _old_name(target, ".tmp")
    other.write_bytes(b"another writer's partial tarball")
    report = export_tar(ArtifactPool(pool), served, target)
    assert report.artifacts == len(served)
    assert other.read_bytes() == b"another writer's partial tarball"
    with tarfile.open(target) as archive:
        assert sorted(archive.getnames()) == sorted(["checksums.txt", *(a.name for a in served)])


def test_export_tar_whose_temporary_name_is_taken_is_a_clear_refusal(
    tmp_path: Path, pool: Path, served: list[Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The name is made guessable again: the create must fail without touching it.
    monkeypatch.setattr(export_module, "_temp_path", lambda t: _old_name(t, ".tmp"),
                        raising=False)
    target = tmp_path / "set.tar"
    other = _old_name(target, ".tmp")
    other.write_bytes(b"another writer's partial tarball")
    with pytest.raises(PoolError) as refused:
        export_tar(ArtifactPool(pool), served, target)
    message = str(refused.value)
    assert message.startswith(f"cannot export to {target}: ")
    assert str(other) in message and "export again" in message
    assert other.read_bytes() == b"another writer's partial tarball"
    assert sorted(tmp_path.iterdir()) == sorted([tmp_path / "origin", pool, other])
