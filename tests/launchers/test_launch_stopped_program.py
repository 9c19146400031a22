"""A SIGSTOP sent to PROGRAM itself does not stop `python -m launch`.

A person pauses one rank by the pid `ps` or `nvidia-smi` shows (PROGRAM's, not the
wrapper's) and continues it the same way. A wrapper that stopped with it would see
neither, and its launcher would wait on it after PROGRAM had exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.launchers.procs import LAUNCH, PY, REPO, as_on_a_terminal, base_env
from tests.support.process import kill_group

#: PROGRAM: survives SIGINT (writes ``survived``), writes its pid, then waits for
#: ``go`` and exits 7.
_PROGRAM = """
import os, signal, time
signal.signal(signal.SIGINT, lambda *_: open({survived!r}, "w").close())
open({pidfile!r} + ".tmp", "w").write(str(os.getpid()))
os.rename({pidfile!r} + ".tmp", {pidfile!r})
while not os.path.exists({go!r}):
    time.sleep(0.02)
raise SystemExit(7)
"""


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2]
    return "gone"


def _until(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s"
        time.sleep(0.02)


@contextlib.contextmanager
def _launched(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The wrapper running PROGRAM, and PROGRAM's pid; both killed on the way out."""
    pidfile = tmp_path / "pid"
    program = _PROGRAM.format(pidfile=str(pidfile), go=str(tmp_path / "go"),
                              survived=str(tmp_path / "survived"))
    proc = subprocess.Popen([*LAUNCH, "--", PY, "-c", program], env=base_env(), cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=as_on_a_terminal)
    pid = None
    try:
        _until("the program started", pidfile.exists, 60)
        pid = int(pidfile.read_text())
        yield proc, pid
    finally:
        kill_group(proc)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    _until("the program stopped", lambda: _state(pid) == "T")


def _continue_to_its_end(proc: subprocess.Popen[bytes], pid: int, tmp_path: Path) -> None:
    os.kill(pid, signal.SIGCONT)
    (tmp_path / "go").touch()
    output = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 7, output


def test_a_program_stopped_and_continued_directly_exits_through_the_wrapper(
        tmp_path: Path) -> None:
    with _launched(tmp_path) as (proc, pid):
        _stop(pid)
        time.sleep(0.5)  # time enough for a wrapper that follows it to stop too
        assert _state(proc.pid) != "T", "the wrapper stopped with its program"
        _continue_to_its_end(proc, pid, tmp_path)


def test_a_signal_forwarded_to_a_program_stopped_directly_reaches_it(tmp_path: Path) -> None:
    # The wrapper knows PROGRAM is stopped, or learns it only after passing the signal
    # on: either way the ending signal is followed by SIGCONT, or PROGRAM would never
    # handle it.
    with _launched(tmp_path) as (proc, pid):
        _stop(pid)
        os.kill(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=30)[0].decode()
        assert proc.returncode == -signal.SIGTERM, output


def test_a_program_that_survived_a_forwarded_signal_can_still_be_paused(
        tmp_path: Path) -> None:
    # Only a stop with an ending signal waiting on it is continued by the wrapper: a
    # person pausing the program later keeps it paused.
    with _launched(tmp_path) as (proc, pid):
        os.kill(proc.pid, signal.SIGINT)
        _until("the program handled SIGINT", (tmp_path / "survived").exists)
        _stop(pid)
        time.sleep(0.5)  # time enough for the wrapper to see the stop
        assert _state(pid) == "T", "the wrapper continued a program paused on purpose"
        _continue_to_its_end(proc, pid, tmp_path)
