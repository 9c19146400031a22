"""``distcache prefetch --manifest PATH`` where PATH is a named pipe with no writer or a
device: refused at once, naming the path, rather than waiting for ever on the open;
a pipe a shell makes (``<(command)``) is still read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import cli_env

#: Far beyond what the refusal takes; a command still running then is waiting on the open.
BOUND_S = 60


def run_bounded(env: dict[str, str], *args: str,
                pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m distcache ARGS`` in a session of its own; its process group is
    killed, and the test fails, if it has not ended within :data:`BOUND_S`."""
    proc = subprocess.Popen([sys.executable, "-m", "distcache", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, pass_fds=pass_fds)
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"distcache {' '.join(args)} still waited after {BOUND_S} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_named_pipe_without_a_writer_is_refused_naming_it(
        tmp_path: Path, artifact_dir: Path, dry_run: bool) -> None:
    fifo = tmp_path / "manifest.fifo"
    os.mkfifo(fifo)
    pool = tmp_path / "pool"
    done = run_bounded(cli_env(tmp_path), "--pool", str(pool), "prefetch", "--manifest",
                       str(fifo), "--origin", str(artifact_dir),
                       *(["--dry-run"] if dry_run else []))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"--manifest {fifo} is a named pipe (FIFO), not a regular file" in done.stderr, \
        done.stderr
    assert "write the manifest to a file" in done.stderr, done.stderr
    assert not pool.exists()  # refused before the pool is made


def test_a_device_given_as_a_manifest_is_refused(tmp_path: Path, artifact_dir: Path) -> None:
    done = run_bounded(cli_env(tmp_path), "--pool", str(tmp_path / "pool"), "prefetch",
                       "--manifest", "/dev/null", "--origin", str(artifact_dir))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "--manifest /dev/null is a character device, not a regular file" in done.stderr, \
        done.stderr


def test_a_manifest_file_beside_a_named_pipe_is_refused_with_it(
        tmp_path: Path, artifact_dir: Path) -> None:
    fifo = tmp_path / "second.fifo"
    os.mkfifo(fifo)
    done = run_bounded(cli_env(tmp_path), "--pool", str(tmp_path / "pool"), "prefetch",
                       "--manifest", str(artifact_dir / "checksums.txt"), "--manifest",
                       str(fifo), "--origin", str(artifact_dir))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"--manifest {fifo} is a named pipe" in done.stderr, done.stderr


def test_a_pipe_made_by_the_shell_is_still_read(tmp_path: Path, artifact_dir: Path) -> None:
    text = (artifact_dir / "checksums.txt").read_text()
    read, write = os.pipe()
    try:
        os.write(write, text.encode())  # well under a pipe's buffer
        os.close(write)
        done = run_bounded(cli_env(tmp_path), "--pool", str(tmp_path / "pool"), "prefetch",
                           "--manifest", f"/dev/fd/{read}", "--origin", str(artifact_dir),
                           "--dry-run", "--json", pass_fds=(read,))
    finally:
        os.close(read)
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert listed["artifacts"] == len(text.splitlines()) > 0, listed
    assert len(listed["missing"]) == listed["artifacts"]  # a new pool lacks them all
