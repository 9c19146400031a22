"""A signal ignored when `python -m launch` starts stays ignored for PROGRAM.

`nohup` ignores SIGHUP, and a shell starts a background job with SIGINT and SIGQUIT
ignored; the program run directly inherits those ignores. Under the wrapper it lost
them (the wrapper installed its forwarding handlers, which exec resets to the
default), and a SIGHUP to a nohup'd wrapper killed the program. Signals not ignored
are still passed on (the guard).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.launchers.procs import LAUNCH, PY, REPO, as_on_a_terminal, base_env
from tests.support.process import kill_group

IGNORED = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM")

#: PROGRAM: writes each signal's disposition and its parent's pid (the wrapper's),
#: then waits for ``go`` and exits 0.
_PROGRAM = """
import json, os, signal, sys, time
said = {{name: str(signal.getsignal(getattr(signal, name))) for name in {names!r}}}
said["wrapper"] = os.getppid()
open({out!r} + ".tmp", "w").write(json.dumps(said))
os.rename({out!r} + ".tmp", {out!r})
while not os.path.exists({go!r}):
    time.sleep(0.02)
"""


def _ignoring(*names: str) -> Callable[[], None]:
    """A preexec function: ``names`` ignored in the child before it execs the wrapper,
    the others at their defaults (as on a terminal)."""
    def ignore() -> None:
        as_on_a_terminal()
        for name in names:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    return ignore


def _run(tmp_path: Path, ignored: tuple[str, ...]) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    out, go = tmp_path / "said.json", tmp_path / "go"
    program = _PROGRAM.format(names=IGNORED, out=str(out), go=str(go))
    proc = subprocess.Popen([*LAUNCH, "--", PY, "-c", program], env=base_env(), cwd=REPO,
                            start_new_session=True, preexec_fn=_ignoring(*ignored),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            raise AssertionError(f"the program never reported: {proc.communicate()[0]!r}")
        time.sleep(0.02)
    return proc, json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_signals_ignored_on_entry_stay_ignored_and_are_not_passed_on(tmp_path: Path) -> None:
    proc, said = _run(tmp_path, IGNORED)
    try:
        assert said["wrapper"] == proc.pid
        for name in IGNORED:
            assert said[name] == str(signal.SIG_IGN), said
        # A closing terminal's SIGHUP to the nohup'd wrapper, a TERM: the run goes on.
        os.kill(proc.pid, signal.SIGHUP)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None
        (tmp_path / "go").touch()
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 0, output
    finally:
        kill_group(proc)


@pytest.mark.timeout(120)
def test_signals_not_ignored_are_still_passed_on(tmp_path: Path) -> None:
    proc, said = _run(tmp_path, ())
    try:
        for name in ("SIGHUP", "SIGQUIT", "SIGTERM"):
            assert said[name] == str(signal.SIG_DFL), said
        os.kill(proc.pid, signal.SIGHUP)
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == -signal.SIGHUP, output  # the program's end, passed on
    finally:
        kill_group(proc)
