"""The command line where its inputs and surroundings are unusual: a manifest given
through a pipe, a pool this user cannot enter, list or write (or one of a newer
format), and a closed stderr."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distcache import cli
from tests.support.cli import cli_env, run_cli, run_read_only


def _pooled(tmp_path: Path, artifact_dir: Path) -> tuple[Path, dict[str, str]]:
    """A pool that holds ``artifact_dir``'s artifacts, and the environment to run in."""
    env = cli_env(tmp_path)
    pool = tmp_path / "pool"
    done = run_cli(env, "--pool", str(pool), "fetch", "--manifest",
                   str(artifact_dir / "checksums.txt"), "--origin", str(artifact_dir))
    assert done.returncode == 0, done.stderr
    return pool, env


def _run_with_pipe(env: dict[str, str], text: str,
                   *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m distcache ARGS`` with ``{pipe}`` in ``args`` naming a pipe that holds
    ``text`` (as ``<(cat FILE)`` in a shell): it can be read once."""
    read, write = os.pipe()
    try:
        os.write(write, text.encode())  # well under a pipe's buffer
        os.close(write)
        named = [arg.replace("{pipe}", f"/dev/fd/{read}") for arg in args]
        return subprocess.run([sys.executable, "-m", "distcache", *named], capture_output=True,
                              text=True, env=env, timeout=120, pass_fds=(read,), check=False)
    finally:
        os.close(read)


def _run_without_stderr(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m distcache ARGS`` with its stderr closed (``2>&-``)."""
    return subprocess.run([sys.executable, "-m", "distcache", *args], stdout=subprocess.PIPE,
                          text=True, env=env, timeout=120, check=False,
                          preexec_fn=lambda: os.close(2))


def _denied_under(monkeypatch: pytest.MonkeyPatch, where: Path,
                  names: tuple[str, ...] = ("stat", "lstat", "scandir")) -> None:
    """Make ``os``'s ``names`` raise EACCES for every path below ``where`` (and, for
    ``scandir``, ``where`` itself), as for a user without search permission there
    (the tests run as root, whom permissions do not stop)."""
    for name in names:
        real: Callable[..., Any] = getattr(os, name)

        def denied(path: Any = ".", *args: Any, _real: Callable[..., Any] = real,
                   _name: str = name, **kwargs: Any) -> Any:
            text = os.fspath(path) if not isinstance(path, int) else ""
            if text.startswith(f"{where}{os.sep}") or (_name == "scandir" and text == str(where)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), text)
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, denied)


def _pool_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    """Run ``doctor`` in-process: the exit status, its ``pool`` line and stderr."""
    status = cli.main([*argv, "doctor"])
    out, err = capsys.readouterr()
    line = next((x for x in out.splitlines() if x.startswith("pool:")), "")
    return status, line, err


# -- prefetch --manifest from a pipe -----------------------------------------------------


def test_prefetch_reads_a_manifest_given_through_a_pipe(tmp_path: Path,
                                                        artifact_dir: Path) -> None:
    env = cli_env(tmp_path)
    manifest = (artifact_dir / "checksums.txt").read_text()
    pool = tmp_path / "pool"
    done = _run_with_pipe(env, manifest, "--pool", str(pool), "prefetch", "--manifest",
                          "{pipe}", "--origin", str(artifact_dir), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["summary"] is not None, report
    listed = run_cli(env, "--pool", str(pool), "pool", "ls")
    assert len(listed.stdout.splitlines()) == len(manifest.splitlines())


def test_prefetch_names_a_manifest_file_in_its_errors(tmp_path: Path,
                                                      artifact_dir: Path) -> None:
    # A regular file is still named where the prefetch says what to run.
    env = cli_env(tmp_path)
    manifest = artifact_dir / "checksums.txt"
    done = run_cli(env, "--pool", str(tmp_path / "pool"), "prefetch", "--manifest",
                   str(manifest))
    assert done.returncode == 1
    assert f"--manifest {manifest}" in done.stderr, done.stderr


# -- doctor on pools it cannot use -----------------------------------------------------


def test_doctor_reports_a_pool_path_it_cannot_enter(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "secret"
    (secret / "inner").mkdir(parents=True)
    pool = secret / "inner" / "pool"
    _denied_under(monkeypatch, secret)
    for json_out in ([], ["--json"]):
        status = cli.main(["--pool", str(pool), "doctor", *json_out])
        out, err = capsys.readouterr()
        assert status == 0 and not err, err
        said = (json.loads(out)["pool"] if json_out
                else next(x for x in out.splitlines() if x.startswith("pool:")))
        assert f"{pool} (NOT USABLE: " in said and "Permission denied" in said, said


def test_doctor_reports_a_pool_of_a_newer_format(tmp_path: Path, artifact_dir: Path) -> None:
    pool, env = _pooled(tmp_path, artifact_dir)
    (pool / "format").chmod(0o644)
    (pool / "format").write_text("99\n")
    done = run_cli(env, "--pool", str(pool), "doctor")
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("pool:"))
    assert "NOT USABLE" in line and "format 99" in line and "(exists)" not in line, line
    assert (pool / "format").read_text() == "99\n"  # looked at, not migrated


def test_doctor_reports_a_pool_this_user_cannot_write(tmp_path: Path, artifact_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    pool, _ = _pooled(tmp_path, artifact_dir)
    real = os.access

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        inside = os.fspath(path) == str(pool) or os.fspath(path).startswith(f"{pool}{os.sep}")
        return False if inside and mode & os.W_OK else real(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    status, line, err = _pool_line(capsys, ["--pool", str(pool)])
    assert status == 0 and not err, err
    assert "read-only" in line and "(exists)" not in line, line


def test_doctor_reports_a_pool_on_a_read_only_mount(tmp_path: Path, artifact_dir: Path) -> None:
    pool, env = _pooled(tmp_path, artifact_dir)
    done = run_read_only(env, pool, [sys.executable, "-m", "distcache", "--pool", str(pool),
                                     "doctor"])
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("pool:"))
    assert "read-only" in line, line


def test_doctor_reports_objects_it_cannot_list(tmp_path: Path, artifact_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    pool, _ = _pooled(tmp_path, artifact_dir)
    real = os.access

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        return False if os.fspath(path) == str(pool / "objects") else real(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    status, line, err = _pool_line(capsys, ["--pool", str(pool)])
    assert status == 0 and not err, err
    assert "NOT USABLE" in line and "objects" in line, line


def test_doctor_still_says_exists_for_a_usable_pool(tmp_path: Path, artifact_dir: Path) -> None:
    pool, env = _pooled(tmp_path, artifact_dir)
    done = run_cli(env, "--pool", str(pool), "doctor")
    assert done.returncode == 0, done.stderr
    assert f"pool:         {pool} (exists)" in done.stdout.splitlines(), done.stdout


# -- pool ls on objects it cannot list -------------------------------------------------


def test_pool_ls_fails_where_objects_cannot_be_listed(tmp_path: Path, artifact_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    pool, _ = _pooled(tmp_path, artifact_dir)
    _denied_under(monkeypatch, pool / "objects")
    for json_out in ([], ["--json"]):
        status = cli.main(["--pool", str(pool), "pool", "ls", *json_out])
        out, err = capsys.readouterr()
        assert status == 1 and not out, out
        assert f"cannot list {pool / 'objects'}: Permission denied" in err, err


def test_pool_ls_lists_what_the_pool_holds(tmp_path: Path, artifact_dir: Path) -> None:
    pool, env = _pooled(tmp_path, artifact_dir)
    victim = next(p for p in (pool / "objects").rglob("*") if p.is_file())
    victim.unlink()  # a label whose object is gone is not listed
    done = run_cli(env, "--pool", str(pool), "pool", "ls")
    manifest = (artifact_dir / "checksums.txt").read_text().splitlines()
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == len(manifest) - 1
    assert victim.name not in done.stdout


# -- a closed stderr -------------------------------------------------------------------


def test_an_error_with_stderr_closed_leaves_stdout_alone(tmp_path: Path) -> None:
    done = _run_without_stderr(cli_env(tmp_path), "--pool", str(tmp_path / "none"), "pool",
                               "stats", "--json")
    assert done.returncode == 1
    assert done.stdout == ""


def test_verify_with_stderr_closed_prints_one_json_document(tmp_path: Path,
                                                            artifact_dir: Path) -> None:
    pool, env = _pooled(tmp_path, artifact_dir)
    victim = next(p for p in (pool / "objects").rglob("*") if p.is_file())
    victim.chmod(0o644)
    victim.write_bytes(b"garbage")
    done = _run_without_stderr(env, "--pool", str(pool), "pool", "verify", "--json")
    assert done.returncode == 3
    assert json.loads(done.stdout)["corrupt"] == 1


def test_fetch_failures_with_stderr_closed_print_one_json_document(tmp_path: Path,
                                                                   artifact_dir: Path) -> None:
    env = cli_env(tmp_path)
    manifest = tmp_path / "need.txt"
    manifest.write_text((artifact_dir / "checksums.txt").read_text()
                        + f"{'0' * 64}  not/there.bin\n")
    done = _run_without_stderr(env, "--pool", str(tmp_path / "pool"), "fetch", "--manifest",
                               str(manifest), "--origin", str(artifact_dir), "--json")
    assert done.returncode == 1
    assert json.loads(done.stdout)["failed"] == 1


@pytest.mark.parametrize("argv", [
    ["prefetch", "--record", "x", "--manifest", "m.txt"],
    ["pool", "stats", "--json"],
], ids=["prefetch-usage", "missing-pool"])
def test_error_lines_go_nowhere_without_stderr(tmp_path: Path, argv: list[str],
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stderr", None)
    status = cli.main(["--pool", str(tmp_path / "none"), "-v", *argv])
    assert status in (1, 2)
    assert capsys.readouterr().out == ""
