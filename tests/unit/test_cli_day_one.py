"""What a first day in a real deployment runs into, through the real command line:
Ctrl-C in ``fetch`` and ``prefetch``, a read-only pool, and typos."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.cli import cli_env, run_cli, run_read_only, signal_mid_download


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(tmp_path)


distcache = run_cli


# --- Ctrl-C -----------------------------------------------------------------------------


def _interrupt(tmp_path: Path, env: dict[str, str], *command: str,
               sig: int = signal.SIGINT, again: float | None = None) -> tuple[int, float, str]:
    """Start ``distcache --pool P COMMAND --manifest M --origin URL`` against a slow
    origin, send ``sig`` once downloads are writing into tmp/ (and ``again`` seconds
    later once more), and return the exit status, the seconds from the signal to the
    exit, and stderr."""
    served = tmp_path / "origin"
    make_artifacts(served, 20, min_size=200_000, max_size=300_000, seed=5)
    pool = tmp_path / "pool"
    # 200 kB/s for ~5 MB: the whole queue would take about 25 s.
    with LoopbackOrigin(served, bandwidth=200_000) as origin:
        status, elapsed, stderr = signal_mid_download(
            [sys.executable, "-m", "distcache", "--pool", str(pool), *command,
             "--manifest", str(served / "checksums.txt"), "--origin", origin.url],
            env, pool, sig, again)
        # The queue was left, not downloaded (the caller checks how soon it stopped).
        held = sum(1 for _ in (pool / "objects").rglob("*") if _.is_file())
        assert held < 20, (held, origin.total_requests, elapsed, stderr)
    assert list((pool / "tmp").iterdir()) == []
    return status, elapsed, stderr


def test_ctrl_c_stops_fetch_within_a_second_and_removes_its_temp_files(
    tmp_path: Path, env: dict[str, str]
) -> None:
    status, elapsed, stderr = _interrupt(tmp_path, env, "fetch", "--jobs", "4")
    assert status == 130, stderr
    assert elapsed < 1.0, f"exit {elapsed:.2f} s after SIGINT"
    assert "interrupted" in stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_the_clean_up_still_leaves_no_temp_file(
    tmp_path: Path, env: dict[str, str], sig: int,
) -> None:
    # Two Ctrl-C 20 ms apart, or `timeout` signalling the command and then its group:
    # the second arrived while the first's clean-up waited for the downloads, and
    # ended it before their temporary files were removed.
    status, _elapsed, stderr = _interrupt(tmp_path, env, "fetch", "--jobs", "4", sig=sig,
                                          again=0.02)
    assert status == 128 + sig, stderr


def test_ctrl_c_in_prefetch_removes_its_temp_files(tmp_path: Path, env: dict[str, str]) -> None:
    status, elapsed, stderr = _interrupt(tmp_path, env, "prefetch")
    assert status == 130, stderr
    assert elapsed < 1.0, f"exit {elapsed:.2f} s after SIGINT"


# --- a read-only pool ---------------------------------------------------------------------


def _read_only(env: dict[str, str], directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``distcache ARGS`` with ``directory`` bind-mounted read-only."""
    return run_read_only(env, directory, [sys.executable, "-m", "distcache", *args])


@pytest.fixture
def served(tmp_path: Path) -> Path:
    root = tmp_path / "origin"
    make_artifacts(root, 17, min_size=1_000, max_size=4_000, seed=6)
    return root


@pytest.mark.parametrize("read_only", ["pool", "tmp"])
def test_fetch_into_a_read_only_pool_says_so_in_one_line(
    tmp_path: Path, env: dict[str, str], served: Path, read_only: str
) -> None:
    pool = tmp_path / "pool"
    ArtifactPool(pool)
    done = _read_only(env, pool if read_only == "pool" else pool / "tmp", "--pool", str(pool),
                      "fetch", "--manifest", str(served / "checksums.txt"), "--origin", str(served))
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if not line.startswith("distcache: WARN")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"distcache: error: pool {pool} is not writable: ")
    assert "Read-only file system" in errors[0]


def test_gc_that_cannot_remove_what_it_was_asked_to_exits_non_zero(
    tmp_path: Path, env: dict[str, str], served: Path
) -> None:
    pool = tmp_path / "pool"
    assert distcache(env, "--pool", str(pool), "pool", "import", str(served)).returncode == 0
    done = _read_only(env, pool, "--pool", str(pool), "pool", "gc", "--max-bytes", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"distcache: error: pool gc: {pool} still holds ")
    assert "over the cap of 1 B" in last and "the pool is not writable" in last
    nothing_asked = _read_only(env, pool, "--pool", str(pool), "pool", "gc",
                               "--max-bytes", "1G")
    assert nothing_asked.returncode == 0, nothing_asked.stderr


# --- typos ------------------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--frobnicate"], ["fetch", "--frobnicate"],
                                  ["pool", "--frobnicate"], ["--pool", "p", "--frobnicate"]])
def test_an_unknown_option_is_named(env: dict[str, str], args: list[str]) -> None:
    done = distcache(env, *args)
    assert done.returncode == 2
    assert "unrecognized arguments: --frobnicate" in done.stderr
    assert "required" not in done.stderr


def test_a_record_directory_that_does_not_exist_is_refused(
    tmp_path: Path, env: dict[str, str], served: Path
) -> None:
    missing = tmp_path / "no-such-record"
    done = distcache(env, "--pool", str(tmp_path / "pool"), "prefetch", "--flashinfer",
                     "--record", str(missing), "--origin", str(served))
    assert done.returncode == 1
    assert f"--record {missing}: no such directory" in done.stderr


def test_an_origin_without_a_scheme_is_one_line(
    tmp_path: Path, env: dict[str, str], served: Path
) -> None:
    done = distcache(env, "--pool", str(tmp_path / "pool"), "fetch",
                     "--manifest", str(served / "checksums.txt"), "--origin", "127.0.0.1:42505")
    assert done.returncode in (1, 2)
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "127.0.0.1:42505" in done.stderr and "scheme" in done.stderr


def test_a_manifest_error_names_the_file_and_line(tmp_path: Path, env: dict[str, str]) -> None:
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(f"{'a' * 64}  ok.cubin\nnot a checksum line\n")
    done = distcache(env, "--pool", str(tmp_path / "pool"), "fetch", "--manifest", str(manifest),
                     "--origin", str(tmp_path))
    assert done.returncode == 1
    assert f"{manifest}:2: expected '<64 hex sha256>" in done.stderr
