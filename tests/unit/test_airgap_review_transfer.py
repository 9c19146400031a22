"""``pool import`` and ``pool export --tar`` at edges a transfer meets: an archive whose
``checksums.txt`` files would fill memory, a source with no file at all (a tarball of
zeros reads as an empty archive), a ``--tar`` target that is a symbolic link, and the
tarball's directory entry flushed once it is renamed into place."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

import distcache.store._export as export_module
import distcache.store._import as import_module
from distcache.artifact import Artifact
from distcache.errors import ConfigError
from distcache.store import ArtifactPool
from distcache.store._export import export_tar
from distcache.store._import import import_set
from tests.support.helpers import clear_settings


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _pool_of(root: Path, files: dict[str, bytes]) -> ArtifactPool:
    pool = ArtifactPool(root)
    pool.remember([Artifact(name, pool.put(data)) for name, data in files.items()])
    return pool


# --- checksums.txt files are read whole: together they are capped ----------------------


def test_a_checksums_txt_larger_than_a_manifest_may_be_is_refused_before_it_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(import_module, "MAX_MANIFEST_BYTES", 4096, raising=False)
    kernel = b"K" * 100
    listing = f"{_sha(kernel)}  k.cubin\n".encode() + b"#" * 5000 + b"\n"
    source = _tar(tmp_path / "set.tar.gz", {"pin/checksums.txt": listing,
                                            "pin/k.cubin": kernel})
    pool = ArtifactPool(tmp_path / "pool")
    with pytest.raises(ConfigError, match=r"pin/checksums\.txt.*4096"):
        import_set(pool, source)
    assert pool.names() == {}


def test_checksums_txt_files_together_past_the_cap_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(import_module, "MAX_MANIFEST_BYTES", 4096, raising=False)
    files = {f"pin{i}/checksums.txt": b"#" * 1500 + b"\n" for i in range(4)}
    pool = ArtifactPool(tmp_path / "pool")
    with pytest.raises(ConfigError, match=r"pin2/checksums\.txt.*4096"):
        import_set(pool, _tar(tmp_path / "set.tar.gz", files))
    assert pool.names() == {}


def test_checksums_txt_files_within_the_cap_still_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(import_module, "MAX_MANIFEST_BYTES", 4096, raising=False)
    kernel = b"K" * 100
    listing = f"{_sha(kernel)}  k.cubin\n".encode()
    pool = ArtifactPool(tmp_path / "pool")
    report = import_set(pool, _tar(tmp_path / "set.tar.gz", {
        "pin/checksums.txt": listing, "pin/k.cubin": kernel}))
    assert report.artifacts == 2
    assert pool.names() == {"pin/k.cubin": _sha(kernel), "pin/checksums.txt": _sha(listing)}


# --- a source with no file at all ------------------------------------------------------


@pytest.mark.parametrize("make", ["zeros", "empty-tar", "empty-dir"])
def test_a_source_with_no_file_at_all_is_refused_not_imported_as_nothing(
        tmp_path: Path, make: str) -> None:
    source = tmp_path / ("set.tar" if make != "empty-dir" else "set")
    if make == "zeros":  # a transfer whose bytes never reached the disk
        source.write_bytes(bytes(10240))
    elif make == "empty-tar":
        tarfile.open(source, "w").close()
    else:
        source.mkdir()
    pool = ArtifactPool(tmp_path / "pool")
    with pytest.raises(ConfigError, match=r"holds no file"):
        import_set(pool, source)


def test_an_exported_empty_set_still_imports(tmp_path: Path) -> None:
    # Its checksums.txt says it is a set, one that lists nothing.
    pool = _pool_of(tmp_path / "src", {})
    target = tmp_path / "set.tar"
    export_tar(pool, [], target)
    report = import_set(ArtifactPool(tmp_path / "dst"), target)
    assert (report.artifacts, report.manifests) == (0, 1)


# --- pool export --tar ---------------------------------------------------------------------


def test_export_tar_to_a_symbolic_link_replaces_the_file_it_points_at(tmp_path: Path) -> None:
    files = {"k.cubin": b"K" * 100}
    pool = _pool_of(tmp_path / "pool", files)
    drive = tmp_path / "drive"
    drive.mkdir()
    (drive / "kernels.tar").write_bytes(b"last week's set")
    link = tmp_path / "kernels.tar"
    link.symlink_to(drive / "kernels.tar")
    export_tar(pool, [Artifact("k.cubin", _sha(files["k.cubin"]))], link)
    assert link.is_symlink()
    with tarfile.open(drive / "kernels.tar") as archive:
        assert archive.getnames() == ["checksums.txt", "k.cubin"]
    assert sorted(p.name for p in drive.iterdir()) == ["kernels.tar"]


def test_export_tar_flushes_its_directory_once_the_tarball_is_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"k.cubin": b"K" * 100}
    pool = _pool_of(tmp_path / "pool", files)
    target = tmp_path / "out" / "kernels.tar"
    target.parent.mkdir()
    flushed: list[tuple[str, bool]] = []
    monkeypatch.setattr(export_module, "fsync_dir", lambda path: flushed.append(
        (os.fspath(path), os.path.exists(target))), raising=False)
    export_tar(pool, [Artifact("k.cubin", _sha(files["k.cubin"]))], target)
    assert (str(target.parent), True) in flushed
