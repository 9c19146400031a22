"""``--json`` on every command that reports: one JSON document on stdout, holding the
same facts as the text, and the same exit codes."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from distcache import cli
from distcache.artifact import Artifact
from distcache.cli import _doctor, _main
from distcache.testing import LoopbackOrigin


class Cli(Protocol):
    def __call__(self, *args: str) -> tuple[int, Any, str]: ...


@pytest.fixture
def distcache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Cli:
    """Run ``distcache ARGS`` in this process with no DISTCACHE_* settings; returns
    the exit code, stdout parsed as JSON, and stderr."""
    for name in [k for k in os.environ if k.startswith("DISTCACHE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))

    def run(*args: str) -> tuple[int, Any, str]:
        capsys.readouterr()
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, json.loads(out), err

    return run


@pytest.fixture
def pool_dir(tmp_path: Path, artifact_dir: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    root = tmp_path / "pool"
    assert cli.main(["--pool", str(root), "pool", "import", str(artifact_dir)]) == 0
    capsys.readouterr()
    return root


def _objects(pool: Path) -> list[Path]:
    return sorted(p for p in (pool / "objects").rglob("*") if p.is_file())


def test_pool_ls_json_lists_every_present_artifact(
    distcache: Cli, pool_dir: Path, artifacts: list[Artifact]
) -> None:
    code, data, _ = distcache("--pool", str(pool_dir), "pool", "ls", "--json")
    assert code == 0
    assert data["root"] == str(pool_dir)
    assert sorted((a["name"], a["sha256"]) for a in data["artifacts"]) == sorted(
        (a.name, a.sha256) for a in artifacts
    )


def test_pool_ls_json_leaves_out_names_whose_object_is_gone(
    distcache: Cli, pool_dir: Path, artifacts: list[Artifact]
) -> None:
    victim = _objects(pool_dir)[0]
    victim.unlink()
    code, data, _ = distcache("--pool", str(pool_dir), "pool", "ls", "--json")
    assert code == 0
    assert len(data["artifacts"]) == len(artifacts) - 1
    assert victim.name not in {a["sha256"] for a in data["artifacts"]}


def test_pool_stats_json_counts_objects_and_bytes(
    distcache: Cli, pool_dir: Path, artifacts: list[Artifact]
) -> None:
    code, data, _ = distcache("pool", "stats", "--json", "--pool", str(pool_dir))
    assert code == 0
    assert data["root"] == str(pool_dir)
    assert data["objects"] == data["names"] == len(artifacts)
    assert data["bytes"] == sum(a.size or 0 for a in artifacts)
    assert data["max_bytes"] is None


def test_pool_verify_json_counts_corrupt_objects_and_exits_3(
    distcache: Cli, pool_dir: Path, artifacts: list[Artifact]
) -> None:
    code, clean, _ = distcache("--pool", str(pool_dir), "pool", "verify", "--json")
    assert code == 0
    assert (clean["ok"], clean["corrupt"], clean["quarantined"]) == (len(artifacts), 0, 0)
    assert clean["ok_bytes"] == sum(a.size or 0 for a in artifacts)
    victim = _objects(pool_dir)[0]
    victim.chmod(0o644)
    data = victim.read_bytes()
    victim.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    code, found, err = distcache("--pool", str(pool_dir), "pool", "verify", "--json")
    assert code == 3
    assert (found["ok"], found["corrupt"], found["quarantined"]) == (len(artifacts) - 1, 1, 1)
    assert "quarantine" in err


def test_pool_gc_json_reports_what_was_removed(
    distcache: Cli, pool_dir: Path, artifacts: list[Artifact]
) -> None:
    code, uncapped, _ = distcache("--pool", str(pool_dir), "pool", "gc", "--json")
    assert code == 0
    assert uncapped["max_bytes"] is None
    assert (uncapped["removed"], uncapped["kept"]) == (0, len(artifacts))
    code, data, _ = distcache("--pool", str(pool_dir), "pool", "gc", "--max-bytes", "0", "--json")
    assert code == 0
    assert data["max_bytes"] == 0
    assert (data["removed"], data["kept"], data["kept_bytes"]) == (len(artifacts), 0, 0)
    assert data["freed_bytes"] == sum(a.size or 0 for a in artifacts)
    assert _objects(pool_dir) == []


def test_fetch_json_summary_counts_downloads_then_hits(
    distcache: Cli,
    tmp_path: Path,
    origin_server: LoopbackOrigin,
    artifact_dir: Path,
    artifacts: list[Artifact],
) -> None:
    args = ("--pool", str(tmp_path / "p"), "fetch", "--json",
            "--manifest", str(artifact_dir / "checksums.txt"), "--origin", origin_server.url)
    code, first, err = distcache(*args)
    assert code == 0 and err == ""
    assert first["artifacts"] == first["fetched"] == first["downloaded"] == len(artifacts)
    assert first["downloaded_bytes"] == sum(a.size or 0 for a in artifacts)
    assert (first["already_present"], first["failed"], first["failures"]) == (0, 0, [])
    assert first["root"] == str(tmp_path / "p")
    assert origin_server.url in first["origin"]
    code, second, _ = distcache(*args)
    assert code == 0
    assert (second["downloaded"], second["already_present"]) == (0, len(artifacts))
    assert origin_server.total_requests == len(artifacts)


def test_fetch_json_names_each_failure_and_exits_1(
    distcache: Cli,
    tmp_path: Path,
    origin_server: LoopbackOrigin,
    artifact_dir: Path,
    artifacts: list[Artifact],
) -> None:
    missing = sorted(a.name for a in artifacts[:2])
    for name in missing:
        origin_server.inject("404", path=name, count=None)
    code, data, err = distcache("--pool", str(tmp_path / "p"), "fetch", "--json",
                                "--manifest", str(artifact_dir / "checksums.txt"),
                                "--origin", origin_server.url)
    assert code == 1
    assert (data["failed"], data["fetched"]) == (2, len(artifacts) - 2)
    assert [f["name"] for f in data["failures"]] == missing
    assert all("HTTP 404" in f["error"] for f in data["failures"])
    assert len(err.splitlines()) == 2


def test_doctor_json_holds_every_fact(distcache: Cli, tmp_path: Path) -> None:
    code, data, _ = distcache("--pool", str(tmp_path / "p"), "doctor", "--json")
    assert code == 0
    assert list(data) == ["distcache", "launcher", "pool", "filesystem", "kernel locks",
                          "free space", "/dev/shm", "origins", "cuda ipc"]
    assert data["pool"] == f"{tmp_path / 'p'} (not created yet)"
    assert data["kernel locks"].startswith("work")
    assert data["launcher"].startswith("single")
    assert data["origins"] == "unset (DISTCACHE_ORIGIN)"


def _leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subcommands:
        yield path, parser
    for action in subcommands:
        for name, child in action.choices.items():
            yield from _leaf_parsers(child, (*path, name))


def test_every_command_takes_json() -> None:
    leaves = dict(_leaf_parsers(_main.build_parser()))
    assert ("pool", "rm") in leaves and ("prefetch",) in leaves
    lacking = [" ".join(path) for path, parser in leaves.items()
               if not any("--json" in a.option_strings for a in parser._actions)]
    assert lacking == []


def test_doctor_reports_the_ipc_probes_verdict_where_a_gpu_device_exists(
    distcache: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int | None] = []

    def probe(device: int | None = None) -> tuple[bool, str]:
        calls.append(device)
        return False, "CUDA IPC handles are not usable under WSL2"

    monkeypatch.setattr(_doctor, "_gpu_device_present", lambda: True)
    monkeypatch.setattr(_doctor, "probe_cuda_ipc", probe)
    code, data, _ = distcache("--pool", str(tmp_path / "p"), "doctor", "--json")
    assert code == 0
    assert calls == [None]
    assert data["cuda ipc"] == "unavailable: CUDA IPC handles are not usable under WSL2"


def test_doctor_does_not_probe_without_a_gpu_device(
    distcache: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def probe(device: int | None = None) -> tuple[bool, str]:
        raise AssertionError("probed without a GPU device")

    monkeypatch.setattr(_doctor, "_gpu_device_present", lambda: False)
    monkeypatch.setattr(_doctor, "probe_cuda_ipc", probe)
    code, data, _ = distcache("--pool", str(tmp_path / "p"), "doctor", "--json")
    assert code == 0
    assert data["cuda ipc"].startswith("not checked")
