"""A job of one process named by ``RANK=0 WORLD_SIZE=1`` (a debugging shell's exports)
is as alone as a process no launcher started: local rank 0 of 1, node 0 of 1, and on
a terminal PROGRAM gets the terminal."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import detect
from tests.support.cli import cli_env

REPO = Path(__file__).resolve().parents[2]
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in cli_env(tmp_path).items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env.update(RANK="0", WORLD_SIZE="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def test_rank_0_of_1_is_local_rank_0_of_1_on_node_0_of_1() -> None:
    info = detect({"RANK": "0", "WORLD_SIZE": "1"}, hostname="h")
    assert (info.local_rank, info.local_world_size) == (0, 1)
    assert (info.node_rank, info.num_nodes) == (0, 1)
    assert info.single_node


def test_a_job_of_several_ranks_still_leaves_unknown_local_values_unknown() -> None:
    info = detect({"RANK": "1", "WORLD_SIZE": "2"}, hostname="h")
    assert (info.local_rank, info.local_world_size, info.num_nodes) == (None, None, None)


def test_program_gets_local_rank_and_local_world_size(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launch", "--", sys.executable, "-c",
         "import os; print(os.environ.get('LOCAL_RANK'), os.environ.get('LOCAL_WORLD_SIZE'))"],
        capture_output=True, text=True, env=_env(tmp_path), cwd=REPO, timeout=120,
        start_new_session=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (the wrapper's, made by forkpty)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = (entry / "stat").read_text()
            if int(text[text.rindex(")") + 2:].split()[3]) == sid:
                os.kill(int(entry.name), signal.SIGKILL)


def test_program_reads_a_line_typed_on_the_terminal(tmp_path: Path) -> None:
    program = "import sys; print('READY', flush=True); print('got', sys.stdin.readline().strip())"
    env = _env(tmp_path)
    pid, fd = os.forkpty()
    if pid == 0:  # pragma: no cover - the child execs at once
        try:
            for sig in (signal.SIGINT, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_DFL)  # as a shell on a terminal leaves them
            os.chdir(REPO)
            os.execve(sys.executable, [sys.executable, "-m", "launch", "--", sys.executable,
                                       "-c", program], env)
        finally:
            os._exit(127)
    output, status, typed = b"", None, False
    try:
        deadline = time.monotonic() + 60
        while status is None and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                with contextlib.suppress(OSError):  # EIO once every holder is gone
                    output += os.read(fd, 65536)
            if b"READY" in output and not typed:
                time.sleep(0.3)  # let it reach its read
                os.write(fd, b"hello\n")
                typed = True
            done, raw = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
            if done:
                status = "stopped" if os.WIFSTOPPED(raw) else os.waitstatus_to_exitcode(raw)
        while True:  # what it wrote last
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                break
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
    finally:
        _kill_session(pid)
        if status is None or status == "stopped":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os.close(fd)
    assert status == 0, (status, output.decode(errors="replace"))
    assert b"got hello" in output
