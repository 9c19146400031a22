"""The ``distcache`` command through its real command line (``python -m distcache``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Protocol

import pytest

from distcache import cli
from distcache.artifact import Artifact, parse_checksums, sha256_hex
from distcache.cli import _main
from distcache.testing import LoopbackOrigin

REPO = Path(__file__).resolve().parents[2]


class Run(Protocol):
    def __call__(
        self, *args: str, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]: ...


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with no DISTCACHE_* settings and a private cache home."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    clean.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO)})
    return clean


@pytest.fixture
def run(env: dict[str, str]) -> Run:
    def run(
        *args: str, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "distcache", *args],
            capture_output=True,
            text=True,
            env={**env, **(extra_env or {})},
            timeout=120,
            start_new_session=True,
            check=False,
        )

    return run


@pytest.fixture
def pool_dir(tmp_path: Path, run: Run, artifact_dir: Path) -> Path:
    """A pool filled by ``pool import`` from the artifact directory."""
    root = tmp_path / "pool"
    done = run("--pool", str(root), "pool", "import", str(artifact_dir))
    assert done.returncode == 0, done.stderr
    return root


def _objects(pool: Path) -> list[Path]:
    return sorted(p for p in (pool / "objects").rglob("*") if p.is_file())


def test_import_then_ls_lists_the_manifest(
    pool_dir: Path, run: Run, artifacts: list[Artifact]
) -> None:
    done = run("--pool", str(pool_dir), "pool", "ls")
    assert done.returncode == 0, done.stderr
    listed = parse_checksums(done.stdout)
    assert {(a.name, a.sha256) for a in listed} == {(a.name, a.sha256) for a in artifacts}
    assert len(_objects(pool_dir)) == len(artifacts)


def test_import_reports_what_it_added(
    tmp_path: Path, run: Run, artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    first = run("--pool", str(tmp_path / "p"), "pool", "import", str(artifact_dir))
    again = run("--pool", str(tmp_path / "p"), "pool", "import", str(artifact_dir))
    assert f"imported {len(artifacts)} artifacts" in first.stdout
    assert f"{len(artifacts)} new objects" in first.stdout
    assert "0 new objects" in again.stdout


def test_import_refuses_files_that_do_not_match_checksums(
    tmp_path: Path, run: Run, artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    path = artifact_dir / artifacts[0].name
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    done = run("--pool", str(tmp_path / "p"), "pool", "import", str(artifact_dir))
    assert done.returncode == 1
    assert "sha256 mismatch" in done.stderr and artifacts[0].name in done.stderr
    assert "nothing was imported" in done.stderr
    assert _objects(tmp_path / "p") == []


def test_import_without_checksums_takes_every_regular_file(tmp_path: Path, run: Run) -> None:
    src = tmp_path / "loose"
    (src / "a").mkdir(parents=True)
    (src / "a" / "k1.cubin").write_bytes(b"one")
    (src / "k2.cubin").write_bytes(b"two")
    assert run("--pool", str(tmp_path / "p"), "pool", "import", str(src)).returncode == 0
    listed = run("--pool", str(tmp_path / "p"), "pool", "ls").stdout
    assert listed == (f"{sha256_hex(b'one')}  a/k1.cubin\n{sha256_hex(b'two')}  k2.cubin\n")


def test_stats_reports_counts_as_text_and_json(
    pool_dir: Path, run: Run, artifacts: list[Artifact]
) -> None:
    text = run("pool", "stats", "--pool", str(pool_dir))
    assert text.returncode == 0, text.stderr
    assert f"objects: {len(artifacts)}" in text.stdout
    assert "pool_id: " in text.stdout
    data = json.loads(run("--pool", str(pool_dir), "pool", "stats", "--json").stdout)
    assert data["objects"] == len(artifacts)
    assert data["bytes"] == sum(a.size or 0 for a in artifacts)
    assert data["quarantined"] == 0


def test_verify_exits_3_and_quarantines_a_corrupt_object(pool_dir: Path, run: Run) -> None:
    assert run("--pool", str(pool_dir), "pool", "verify").returncode == 0
    victim = _objects(pool_dir)[0]
    victim.chmod(0o644)
    data = victim.read_bytes()
    victim.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    done = run("--pool", str(pool_dir), "pool", "verify")
    assert done.returncode == 3
    assert "1 corrupt" in done.stdout
    assert "quarantine" in done.stderr
    assert not victim.exists()
    assert run("--pool", str(pool_dir), "pool", "verify").returncode == 0


def test_gc_collects_down_to_the_cap(pool_dir: Path, run: Run, artifacts: list[Artifact]) -> None:
    uncapped = run("--pool", str(pool_dir), "pool", "gc")
    assert uncapped.returncode == 0 and "no size cap" in uncapped.stdout
    assert len(_objects(pool_dir)) == len(artifacts)
    done = run("--pool", str(pool_dir), "pool", "gc", "--max-bytes", "0")
    assert done.returncode == 0, done.stderr
    assert f"removed {len(artifacts)} objects" in done.stdout
    assert _objects(pool_dir) == []


def test_gc_rejects_a_bad_size_in_one_line(pool_dir: Path, run: Run) -> None:
    done = run("--pool", str(pool_dir), "pool", "gc", "--max-bytes", "lots")
    assert done.returncode == 2  # an option's value: bad usage, as argparse's own
    # The subcommand's usage, then one line.
    assert done.stderr.startswith("usage: distcache pool") and done.stderr.count("\n") == 2
    assert "--max-bytes='lots' is not a size" in done.stderr.splitlines()[-1]


def test_export_writes_files_and_checksums(
    pool_dir: Path, run: Run, tmp_path: Path, artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    out = tmp_path / "export"
    done = run("--pool", str(pool_dir), "pool", "export", str(out))
    assert done.returncode == 0, done.stderr
    for a in artifacts:
        assert (out / a.name).read_bytes() == (artifact_dir / a.name).read_bytes()
    exported = parse_checksums((out / "checksums.txt").read_text())
    assert {(a.name, a.sha256) for a in exported} == {(a.name, a.sha256) for a in artifacts}


def test_fetch_downloads_once_then_hits_the_pool(
    tmp_path: Path,
    run: Run,
    origin_server: LoopbackOrigin,
    artifact_dir: Path,
    artifacts: list[Artifact],
) -> None:
    args = (
        "--pool",
        str(tmp_path / "p"),
        "fetch",
        "--manifest",
        str(artifact_dir / "checksums.txt"),
        "--origin",
        origin_server.url,
        "--jobs",
        "4",
    )
    first = run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""  # no progress bar when stderr is not a terminal
    assert f"fetched {len(artifacts)} of {len(artifacts)}" in first.stdout
    assert f"{len(artifacts)} downloaded" in first.stdout
    assert origin_server.total_requests == len(artifacts)
    second = run(*args)
    assert second.returncode == 0
    assert f"{len(artifacts)} already present" in second.stdout
    assert origin_server.total_requests == len(artifacts)


def test_fetch_uses_distcache_origin_and_falls_back_in_order(
    tmp_path: Path,
    run: Run,
    origin_server: LoopbackOrigin,
    artifact_dir: Path,
    artifacts: list[Artifact],
) -> None:
    origin_server.inject("404", path=artifacts[0].name, count=None)
    done = run(
        "--pool",
        str(tmp_path / "p"),
        "fetch",
        "--manifest",
        str(artifact_dir / "checksums.txt"),
        extra_env={"DISTCACHE_ORIGIN": f"{origin_server.url},{artifact_dir}"},
    )
    assert done.returncode == 0, done.stderr
    assert origin_server.total_requests == len(artifacts)
    assert f"fetched {len(artifacts)} of {len(artifacts)}" in done.stdout


def test_fetch_failures_exit_1_with_one_line_each(
    tmp_path: Path,
    run: Run,
    origin_server: LoopbackOrigin,
    artifact_dir: Path,
    artifacts: list[Artifact],
) -> None:
    origin_server.inject("404", path=artifacts[0].name, count=None)
    origin_server.inject("404", path=artifacts[1].name, count=None)
    done = run(
        "--pool",
        str(tmp_path / "p"),
        "fetch",
        "--manifest",
        str(artifact_dir / "checksums.txt"),
        "--origin",
        origin_server.url,
    )
    assert done.returncode == 1
    assert "2 failed" in done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 2
    assert all("HTTP 404" in line for line in lines)
    assert origin_server.total_requests == len(artifacts)  # 404s are not retried


def test_fetch_without_an_origin_names_what_is_missing(
    tmp_path: Path, run: Run, artifact_dir: Path
) -> None:
    done = run(
        "--pool", str(tmp_path / "p"), "fetch", "--manifest", str(artifact_dir / "checksums.txt")
    )
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1
    assert "DISTCACHE_ORIGIN" in done.stderr


def test_doctor_reports_every_field(tmp_path: Path, run: Run) -> None:
    done = run("--pool", str(tmp_path / "p"), "doctor")
    assert done.returncode == 0, done.stderr
    labels = [line.split(":", 1)[0] for line in done.stdout.splitlines()]
    assert labels == [
        "distcache",
        "launcher",
        "pool",
        "filesystem",
        "kernel locks",
        "free space",
        "/dev/shm",
        "origins",
        "cuda ipc",
    ]
    assert "pool:" in done.stdout and str(tmp_path / "p") in done.stdout
    assert "kernel locks: work" in " ".join(done.stdout.split())
    assert "launcher:" in done.stdout and "single" in done.stdout


def test_doctor_reads_the_launcher_from_the_environment(tmp_path: Path, run: Run) -> None:
    done = run(
        "--pool",
        str(tmp_path / "p"),
        "doctor",
        extra_env={
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "3",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "x",
        },
    )
    assert done.returncode == 0, done.stderr
    assert "rank 3 of 8" in done.stdout


def test_pool_and_doctor_commands_do_not_import_torch(pool_dir: Path, env: dict[str, str]) -> None:
    code = (
        "import sys\n"
        "from distcache.cli import main\n"
        f"for args in (['pool', 'stats'], ['pool', 'ls'], ['pool', 'verify'], ['doctor']):\n"
        f"    assert main(['--pool', {str(pool_dir)!r}, *args]) == 0, args\n"
        "print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["pool"],
        ["pool", "frob"],
        ["fetch"],
        ["--frob", "doctor"],
        ["pool", "gc", "--max-bytes"],
    ],
)
def test_bad_usage_exits_2(run: Run, args: list[str]) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert "usage:" in done.stderr
    assert "Traceback" not in done.stderr


def test_errors_are_one_line_unless_verbose(tmp_path: Path, run: Run) -> None:
    missing = tmp_path / "nowhere"
    done = run("--pool", str(missing), "pool", "ls")
    assert done.returncode == 1
    assert done.stderr.startswith("distcache: error: no pool at")
    assert done.stderr.count("\n") == 1
    assert not missing.exists()  # read-only commands never create a pool
    verbose = run("--pool", str(missing), "pool", "ls", "--verbose")
    assert verbose.returncode == 1
    assert "Traceback" in verbose.stderr


def test_help_documents_exit_codes_and_version(run: Run) -> None:
    done = run("--help")
    assert done.returncode == 0
    assert "exit codes:" in done.stdout and "3    'pool verify'" in done.stdout
    assert run("--version").stdout.startswith("distcache ")


def test_pool_defaults_to_distcache_pool(
    pool_dir: Path, run: Run, artifacts: list[Artifact]
) -> None:
    done = run("pool", "ls", extra_env={"DISTCACHE_POOL": str(pool_dir)})
    assert done.returncode == 0
    assert len(done.stdout.splitlines()) == len(artifacts)


def setup_hello(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--who", default="world")
    parser.set_defaults(run=lambda args: print(f"hello {args.who}") or 0)


def test_subcommands_are_registered_from_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = _main.Subcommand("hello", "say hello", setup_hello)
    monkeypatch.setattr(_main, "SUBCOMMANDS", (*_main.SUBCOMMANDS, extra))
    assert cli.main(["hello", "--who", "ranks"]) == 0
    assert capsys.readouterr().out == "hello ranks\n"


def test_a_reader_that_goes_away_is_not_an_error(tmp_path: Path, env: dict[str, str]) -> None:
    # `distcache pool ls | head -1`: the pipe closes long before ls has written
    # everything (far more than a pipe buffer of names).
    from distcache.artifact import Artifact, sha256_hex
    from distcache.store._pool import ArtifactPool

    pool = ArtifactPool(tmp_path / "pool")
    listed = []
    for i in range(1500):
        data = f"object {i}".encode()
        listed.append(Artifact(f"cubins/{'x' * 80}/kernel_{i:05d}.cubin", pool.put(data)))
        assert listed[-1].sha256 == sha256_hex(data)
    pool.remember(listed)
    proc = subprocess.Popen(
        [sys.executable, "-m", "distcache", "--pool", str(tmp_path / "pool"), "pool", "ls"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdout.read(1)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=120)
    finally:
        proc.stderr.close()
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert rc == 0, err
    assert err == ""
