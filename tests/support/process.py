"""Run a command tree under a hard timeout, for tests and benchmarks.

A multi-process job (``mpirun`` and its ranks, a launcher and its workers) is started
in a new session, so that it forms one process group, and the whole group is killed
when the time is up or the leader exits: a rank that hangs fails its caller instead of
outliving it. Output goes to files rather than pipes, since a grandchild that outlives
its parent can hold a pipe open and block the reader.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["kill_group", "mpirun", "run_group"]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``),
    then reap ``proc``. Safe to call when the group is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_group(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: bytes | None = None,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a new session; on timeout SIGKILL its whole process group.

    The group is also killed after a normal exit, so stragglers (daemons a launcher
    left behind) never outlive the test. With ``merge_stderr`` both streams go to
    ``stdout`` in the order they were written, and ``stderr`` is empty.

    Returns:
        The completed process, with ``stdout`` and ``stderr`` as text.

    Raises:
        subprocess.TimeoutExpired: the command ran past ``timeout``; its output so
            far is attached as ``output`` and ``stderr``.
    """
    args = [os.fspath(c) for c in cmd]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=out,
            stderr=out if merge_stderr else err,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
        timed_out = False
        try:
            if input is not None and proc.stdin is not None:
                proc.stdin.write(input)
                proc.stdin.close()
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def mpirun() -> str:
    """The ``mpirun`` that belongs to this interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).with_name("mpirun")
    return str(beside) if beside.exists() else "mpirun"
