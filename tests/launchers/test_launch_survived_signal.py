"""A program that handled a signal the wrapper passed on, and went on, is not being
shut down: what it leaves in its group when it later exits gets SIGTERM and the grace,
not SIGKILL at once (which is kept for a program that ended by, or exited for, such a
signal: tests/launchers/test_launch_leftovers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.launchers.procs import LAUNCH, PY, REPO, base_env
from tests.support.process import kill_group


def _until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s"
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_leftovers_of_a_program_that_survived_a_forwarded_hup_get_the_grace(
    tmp_path: Path,
) -> None:
    got_term, ready, got_hup = (tmp_path / n for n in ("child-got-term", "ready", "got-hup"))
    child = textwrap.dedent(f"""
        import signal, time
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        def term(*_):
            open({str(got_term)!r}, "w").close()
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, term)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """)
    program = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGHUP, lambda *_: open({str(got_hup)!r}, "w").close())
        subprocess.Popen([sys.executable, "-c", {child!r}])
        while not os.path.exists({str(got_hup)!r}):
            time.sleep(0.02)
        time.sleep(0.3)
        sys.exit(0)  # a log reopened on SIGHUP, then a normal end
    """)
    proc = subprocess.Popen([*LAUNCH, "--", PY, "-c", program], env=base_env(), cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        _until("the child started", ready.exists)
        os.kill(proc.pid, signal.SIGHUP)
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, output
        assert got_term.exists(), output  # asked to end first, as any leftover is
        assert "sending them SIGTERM" in output and "killing it" not in output, output
    finally:
        kill_group(proc)
