"""File and directory arguments of the CLI: an empty one (an unset shell variable) is
refused instead of meaning the current directory, and a repeated ``--manifest`` of
``fetch`` and ``pool export`` takes the union instead of the last one alone."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from distcache.cli import main
from distcache.store import ArtifactPool


def _origin(tmp_path: Path) -> tuple[Path, Path, Path]:
    origin = tmp_path / "origin"
    origin.mkdir()
    manifests = []
    for name in ("a.bin", "b.bin"):
        (origin / name).write_bytes(name.encode())
        manifest = tmp_path / f"{name}.txt"
        manifest.write_text(f"{hashlib.sha256(name.encode()).hexdigest()}  {name}\n")
        manifests.append(manifest)
    return origin, manifests[0], manifests[1]


def test_fetch_takes_every_manifest_given(tmp_path: Path) -> None:
    origin, first, second = _origin(tmp_path)
    pool = tmp_path / "pool"
    assert main(["fetch", "--pool", str(pool), "--manifest", str(first), "--manifest",
                 str(second), "--origin", str(origin)]) == 0
    assert sorted(ArtifactPool(pool).names()) == ["a.bin", "b.bin"]


def test_fetch_refuses_one_name_with_two_digests_naming_both_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    origin, first, _ = _origin(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text(f"{'c' * 64}  a.bin\n")
    assert main(["fetch", "--pool", str(tmp_path / "pool"), "--manifest", str(first),
                 "--manifest", str(other), "--origin", str(origin)]) == 1
    err = capsys.readouterr().err
    assert str(first) in err and str(other) in err


def test_export_takes_every_manifest_given(tmp_path: Path) -> None:
    origin, first, second = _origin(tmp_path)
    pool = tmp_path / "pool"
    assert main(["fetch", "--pool", str(pool), "--manifest", str(first), "--manifest",
                 str(second), "--origin", str(origin)]) == 0
    out = tmp_path / "export"
    assert main(["pool", "export", str(out), "--pool", str(pool), "--manifest", str(first),
                 "--manifest", str(second)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["a.bin", "b.bin", "checksums.txt"]


@pytest.mark.parametrize("argv", [
    ["pool", "import", ""],
    ["pool", "export", ""],
    ["pool", "export", "--tar", ""],
    ["pool", "export", "--tar", "x.tar", "--manifest", ""],
    ["fetch", "--manifest", ""],
    ["fetch", "--manifest", " "],
    ["prefetch", "--manifest", ""],
    ["prefetch", "--flashinfer", "--record", ""],
])
def test_an_empty_file_or_directory_argument_is_bad_usage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str]) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "stray.bin").write_bytes(b"would be imported")
    monkeypatch.chdir(work)
    pool = tmp_path / "pool"
    assert main([*argv, "--pool", str(pool)]) == 2
    assert "empty name (an unset variable?)" in capsys.readouterr().err
    assert not pool.exists() and sorted(p.name for p in work.iterdir()) == ["stray.bin"]


@pytest.mark.parametrize("offline", [False, True])
def test_fetch_with_nothing_to_fetch_from_makes_no_pool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        offline: bool) -> None:
    _, first, _ = _origin(tmp_path)
    monkeypatch.delenv("DISTCACHE_ORIGIN", raising=False)
    if offline:
        monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    pool = tmp_path / "pool"
    assert main(["fetch", "--pool", str(pool), "--manifest", str(first)]) == 1
    assert "a.bin" in capsys.readouterr().err
    assert not pool.exists()  # refused for its input: no pool made (docs/cli.md)
