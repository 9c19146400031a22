"""Every signal whose default action would end the wrapper reaches PROGRAM: the
batch systems' warnings (SIGUSR1, SIGXCPU, SIGPWR) and SIGALRM are passed on, so
PROGRAM can checkpoint and go on, and one PROGRAM does not handle ends both."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launch._child import FORWARDED
from tests.launchers.procs import LAUNCH, PY, REPO, base_env
from tests.support.process import kill_group

#: Signals whose default action ends a process, sent from outside by batch systems,
#: power daemons and timers; none of them may end the wrapper behind PROGRAM's back.
OUTSIDE = (signal.SIGALRM, signal.SIGXCPU, signal.SIGPWR, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGVTALRM, signal.SIGPROF)


def _until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s"
        time.sleep(0.02)


def _start(program: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*LAUNCH, "--", PY, "-c", program], env=base_env(), cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def test_terminating_signals_from_outside_are_forwarded() -> None:
    assert set(OUTSIDE) <= set(FORWARDED)


@pytest.mark.timeout(120)
def test_a_program_handles_each_signal_sent_to_the_wrapper_and_goes_on(tmp_path: Path) -> None:
    ready, log = tmp_path / "ready", tmp_path / "got"
    names = [sig.name for sig in OUTSIDE]
    program = textwrap.dedent(f"""
        import signal, sys, time
        got = []
        def note(signum, _):
            got.append(signal.Signals(signum).name)
            with open({str(log)!r}, "a") as out:
                out.write(got[-1] + "\\n")
        for name in {names!r}:
            signal.signal(getattr(signal, name), note)
        open({str(ready)!r}, "w").close()
        while len(got) < {len(names)}:
            time.sleep(0.02)
        sys.exit(7)
    """)
    proc = _start(program)
    try:
        _until("PROGRAM started", ready.exists)
        for count, sig in enumerate(OUTSIDE, 1):
            os.kill(proc.pid, sig)
            _until(f"PROGRAM got {sig.name}",
                   lambda n=count: log.exists() and len(log.read_text().split()) >= n)
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 7, output  # the wrapper lived on, and exits as PROGRAM
        assert log.read_text().split() == names
    finally:
        kill_group(proc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGALRM, signal.SIGPWR])
def test_a_program_that_dies_of_the_signal_takes_the_wrapper_with_it(
    sig: signal.Signals, tmp_path: Path,
) -> None:
    ready, got = tmp_path / "ready", tmp_path / "got"
    program = textwrap.dedent(f"""
        import os, signal, time
        def die(signum, _):
            open({str(got)!r}, "w").close()  # the signal reached PROGRAM itself
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        signal.signal(signal.{sig.name}, die)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """)
    proc = _start(program)
    try:
        _until("PROGRAM started", ready.exists)
        os.kill(proc.pid, sig)
        output = proc.communicate(timeout=60)[0].decode()
        # PROGRAM died of the signal itself (not of the SIGKILL that follows a dead
        # wrapper), and the wrapper died of the same one, as its parent expects.
        assert got.exists(), output
        assert proc.returncode == -sig, output
        assert "still runs" not in output, output
    finally:
        kill_group(proc)
