"""Round trips through ``pool export`` and ``pool import`` that must hold at the edges:
a name that holds a wheel's artifact directory below the top, a damaged archive (a
refusal, never an internal error), and an artifact named ``.../checksums.txt``, which
import reads as a manifest."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.store import ArtifactPool
from tests.support.cli import cli_env, run_cli
from tests.support.helpers import clear_settings


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(tmp_path)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _checksums(files: dict[str, bytes]) -> bytes:
    return "".join(f"{_sha(d)}  {n}\n" for n, d in files.items()).encode()


def _pool_of(root: Path, files: dict[str, bytes]) -> Path:
    """A pool holding ``files``, each labelled with its name."""
    pool = ArtifactPool(root)
    pool.remember([Artifact(name, pool.put(data)) for name, data in files.items()])
    return root


def _labels(env: dict[str, str], pool: Path) -> dict[str, str]:
    done = run_cli(env, "--pool", str(pool), "pool", "ls", "--json")
    assert done.returncode == 0, done.stderr
    return {a["name"]: a["sha256"] for a in json.loads(done.stdout)["artifacts"]}


def _objects(pool: Path) -> list[Path]:
    return sorted(p for p in (pool / "objects").rglob("*") if p.is_file())


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


PIN = "0123456789abcdef0123456789abcdef01234567/fmha"
KERNELS = {"k100.cubin": b"sm100 kernel" * 30, "k90.cubin": b"sm90 kernel" * 30}


def _wheel_members() -> dict[str, bytes]:
    """The members of a flashinfer-cubin wheel: package code, one pin, dist-info."""
    members = {"flashinfer_cubin/__init__.py": b"CUBIN_DIR = None\n",
               f"flashinfer_cubin/cubins/{PIN}/checksums.txt": _checksums(KERNELS)}
    members.update({f"flashinfer_cubin/cubins/{PIN}/{n}": d for n, d in KERNELS.items()})
    members["flashinfer_cubin-9.9.9.dist-info/RECORD"] = b""
    return members


def _wheel_labels() -> dict[str, str]:
    labels = {f"{PIN}/{n}": _sha(d) for n, d in KERNELS.items()}
    labels[f"{PIN}/checksums.txt"] = _sha(_checksums(KERNELS))
    return labels


# --- a name holding flashinfer_cubin/cubins/ below the top -----------------------------


def test_an_export_holding_a_wheel_directory_below_the_top_imports_whole(
        tmp_path: Path, env: dict[str, str]) -> None:
    files = {"a.cubin": b"A" * 100, "vendor/flashinfer_cubin/cubins/k.cubin": b"K" * 100,
             "z.cubin": b"Z" * 100}
    source = _pool_of(tmp_path / "src", files)
    target = tmp_path / "set.tar"
    done = run_cli(env, "--pool", str(source), "pool", "export", "--tar", str(target))
    assert done.returncode == 0, done.stderr
    done = run_cli(env, "--pool", str(tmp_path / "dst"), "pool", "import", str(target))
    assert done.returncode == 0, done.stderr
    assert "3 checked against 1 checksums.txt" in done.stdout
    assert _labels(env, tmp_path / "dst") == {n: _sha(d) for n, d in files.items()}


def test_an_export_holding_the_wheel_directory_at_the_top_imports_whole(
        tmp_path: Path, env: dict[str, str]) -> None:
    # The set's checksums.txt, not the directory's name, says what the set is.
    files = {"a.cubin": b"A" * 100, "flashinfer_cubin/cubins/k.cubin": b"K" * 100}
    source = _pool_of(tmp_path / "src", files)
    target = tmp_path / "set.tar"
    assert run_cli(env, "--pool", str(source), "pool", "export", "--tar",
                   str(target)).returncode == 0
    done = run_cli(env, "--pool", str(tmp_path / "dst"), "pool", "import", str(target))
    assert done.returncode == 0, done.stderr
    assert _labels(env, tmp_path / "dst") == {n: _sha(d) for n, d in files.items()}


def test_a_loose_tarball_with_the_wheel_directory_deeper_keeps_every_name(
        tmp_path: Path, env: dict[str, str]) -> None:
    files = {"a.cubin": b"A" * 10, "vendor/flashinfer_cubin/cubins/k.cubin": b"K" * 10}
    done = run_cli(env, "--pool", str(tmp_path / "dst"), "pool", "import",
                   str(_tar(tmp_path / "loose.tar", files)))
    assert done.returncode == 0, done.stderr
    assert _labels(env, tmp_path / "dst") == {n: _sha(d) for n, d in files.items()}


@pytest.mark.parametrize("top", ["", "site/"])
def test_a_wheel_tree_at_the_top_or_in_one_folder_still_imports_as_the_wheel(
        tmp_path: Path, env: dict[str, str], top: str) -> None:
    members = {top + name: data for name, data in _wheel_members().items()}
    done = run_cli(env, "--pool", str(tmp_path / "dst"), "pool", "import",
                   str(_tar(tmp_path / "wheel.tar", members)))
    assert done.returncode == 0, done.stderr
    assert _labels(env, tmp_path / "dst") == _wheel_labels()


# --- damaged archives ------------------------------------------------------------------


def _corrupt_xz(path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as archive:
        data = bytes(range(256)) * 400
        info = tarfile.TarInfo("a.cubin")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    damaged = bytearray(buffer.getvalue())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))


def _future_zip_version(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        info = zipfile.ZipInfo("flashinfer_cubin/cubins/p/a.cubin")
        info.extract_version = 99  # "needs zip 9.9 to extract"
        archive.writestr(info, b"x" * 100)


def _central_directory_off_by_64(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("flashinfer_cubin/cubins/p/a.cubin", b"x" * 100)
    data = bytearray(path.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    struct.pack_into("<I", data, end + 16, struct.unpack_from("<I", data, end + 16)[0] + 64)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "damage"), [
    ("corrupt.tar.xz", _corrupt_xz),
    ("version.whl", _future_zip_version),
    ("offset.whl", _central_directory_off_by_64),
])
def test_a_damaged_archive_is_refused_not_an_internal_error(
        tmp_path: Path, env: dict[str, str], name: str,
        damage: Callable[[Path], None]) -> None:
    source = tmp_path / name
    damage(source)
    pool = tmp_path / "pool"
    done = run_cli(env, "--pool", str(pool), "pool", "import", str(source))
    assert done.returncode == 1, done.stdout
    assert f"cannot import {source}: " in done.stderr
    assert "nothing was imported" in done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    assert not (pool / "objects").exists() or _objects(pool) == []


# --- an artifact named .../checksums.txt -----------------------------------------------


@pytest.mark.parametrize("how", ["tar", "dir"])
def test_export_refuses_a_nested_checksums_txt_that_is_not_one(
        tmp_path: Path, env: dict[str, str], how: str) -> None:
    files = {"docs/checksums.txt": b"release notes: all kernels checked\n", "k.cubin": b"K" * 64}
    source = _pool_of(tmp_path / "src", files)
    target = tmp_path / ("set.tar" if how == "tar" else "out")
    where = ["--tar", str(target)] if how == "tar" else [str(target)]
    done = run_cli(env, "--pool", str(source), "pool", "export", *where)
    assert done.returncode == 1, done.stdout
    assert "docs/checksums.txt" in done.stderr and "internal error" not in done.stderr
    assert {p.name for p in tmp_path.iterdir()} - {"xdg"} == {"src"}  # nothing written


def test_export_refuses_a_nested_checksums_txt_that_contradicts_the_set(
        tmp_path: Path, env: dict[str, str]) -> None:
    files = {"p/checksums.txt": _checksums({"a.cubin": b"old a"}), "p/a.cubin": b"new a"}
    source = _pool_of(tmp_path / "src", files)
    done = run_cli(env, "--pool", str(source), "pool", "export", "--tar",
                   str(tmp_path / "set.tar"))
    assert done.returncode == 1, done.stdout
    assert "p/checksums.txt" in done.stderr and "p/a.cubin" in done.stderr
    assert not (tmp_path / "set.tar").exists()


def test_a_pin_checksums_txt_exports_and_imports_back(tmp_path: Path,
                                                      env: dict[str, str]) -> None:
    # As a wheel's pins are: the manifest and the files it lists, and one it lists that
    # the set lacks.
    listed = {**KERNELS, "k80.cubin": b"not shipped"}
    files = {f"{PIN}/checksums.txt": _checksums(listed),
             **{f"{PIN}/{n}": d for n, d in KERNELS.items()}}
    source = _pool_of(tmp_path / "src", files)
    target = tmp_path / "set.tar"
    done = run_cli(env, "--pool", str(source), "pool", "export", "--tar", str(target))
    assert done.returncode == 0, done.stderr
    done = run_cli(env, "--pool", str(tmp_path / "dst"), "pool", "import", str(target))
    assert done.returncode == 0, done.stderr
    assert _labels(env, tmp_path / "dst") == {n: _sha(d) for n, d in files.items()}
