"""`python -m launch` on a terminal: the program owns the terminal, and every signal a
user sends (typed or with kill) reaches it.

The wrapper runs on a pseudo-terminal as the leader of a new session with the
terminal as its controlling terminal (``forkpty``: setsid + TIOCSCTTY), the
foreground group, as a shell starts a job.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launchers.procs import REPO, as_on_a_terminal, base_env

PY = sys.executable
#: Generous: two interpreters start and the machine may be loaded.
START_S = 60.0
#: "Within a few seconds" of the signal, on a loaded machine.
REACT_S = 10.0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, session) of ``pid`` from /proc, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[3])


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == sid and stat[0] != "Z":
                members.append(int(entry.name))
    return members


class Terminal:
    """``argv`` on a new pseudo-terminal; what it writes is collected in ``output``."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = os.forkpty()
        if pid == 0:  # pragma: no cover - the child execs at once
            try:
                as_on_a_terminal()  # what a shell on this terminal would leave
                os.chdir(REPO)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.output = b""
        self.status: int | None = None

    def wait_output(self, timeout: float) -> None:
        """Collect what is written within ``timeout`` seconds."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                self.output += os.read(self.fd, 65536)
            except OSError:  # EIO: every holder of the slave side is gone
                time.sleep(timeout)

    def _reap(self) -> None:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)

    def expect(self, text: bytes, timeout: float = START_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            self._reap()
            if self.status is not None:
                self.wait_output(0.5)  # what it wrote last
                if text in self.output:
                    return
                pytest.fail(f"python -m launch exited {self.status} before writing {text!r}; "
                            f"the terminal shows:\n{self.output.decode(errors='replace')}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {text!r} on the terminal within {timeout}s ({self.states()}); "
                            f"it shows:\n{self.output.decode(errors='replace')}")
            self.wait_output(0.1)

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def wait(self, timeout: float) -> int:
        """The wrapper's exit status (``-SIG`` when a signal ended it)."""
        deadline = time.monotonic() + timeout
        while True:
            self._reap()
            if self.status is not None:
                return self.status
            if time.monotonic() > deadline:
                pytest.fail(f"python -m launch still running {timeout}s later ({self.states()}); "
                            f"the terminal shows:\n{self.output.decode(errors='replace')}")
            self.wait_output(0.1)

    def states(self) -> str:
        """``pid:state`` of every process of the session, for failure messages."""
        return " ".join(f"{pid}:{stat[0]}" for pid in _session_members(self.pid)
                        if (stat := _stat(pid)) is not None)

    def close(self) -> None:
        # The program lives in its own group of the wrapper's session: kill the session.
        for _ in range(3):
            for pid in _session_members(self.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@contextlib.contextmanager
def launched(program: str) -> Iterator[Terminal]:
    term = Terminal([PY, "-m", "launch", "--", PY, "-c", textwrap.dedent(program)], base_env())
    try:
        yield term
    finally:
        term.close()


def _program_pid(term: Terminal) -> int:
    deadline = time.monotonic() + START_S
    while (found := re.search(rb"READY (\d+)\r?\n", term.output)) is None:
        term.expect(b"READY ", timeout=max(0.0, deadline - time.monotonic()))
        term.wait_output(0.1)
    return int(found.group(1))


def _wait_state(pid: int, stopped: bool, what: str) -> None:
    deadline = time.monotonic() + REACT_S
    while True:
        stat = _stat(pid)
        assert stat is not None, f"{what} (pid {pid}) is gone"
        if (stat[0] == "T") == stopped:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (pid {pid}) is in state {stat[0]!r}, expected "
                        f"{'stopped' if stopped else 'running'} within {REACT_S}s")
        time.sleep(0.05)


def test_input_reads_a_line_typed_on_the_terminal() -> None:
    with launched("print('got', input())") as term:
        term.type(b"hello\n")
        term.expect(b"got hello")
        assert term.wait(START_S) == 0, term.output


SIGNALLED = """
    import os, signal, sys
    def on_signal(signum, frame):
        with open({marker!r}, "w") as f:
            f.write(signal.Signals(signum).name)
        sys.exit(5)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, on_signal)
    print("READY", os.getpid(), flush=True)
    input()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT],
                         ids=lambda s: s.name)
def test_signal_to_the_wrapper_reaches_a_program_waiting_for_input(
    sig: signal.Signals, tmp_path: Path
) -> None:
    marker = tmp_path / "got"
    with launched(SIGNALLED.format(marker=str(marker))) as term:
        _program_pid(term)
        time.sleep(0.3)  # let it reach input()
        sent = time.monotonic()
        os.kill(term.pid, sig)
        assert term.wait(REACT_S) == 5, term.output
        assert time.monotonic() - sent < REACT_S
        assert marker.read_text() == sig.name


COUNTING = """
    import os, signal
    def on_int(signum, frame):
        with open({marker!r}, "a") as f:
            f.write("INT\\n")
    signal.signal(signal.SIGINT, on_int)
    print("READY", os.getpid(), flush=True)
    while input() != "quit":
        pass
"""


def test_ctrl_c_typed_on_the_terminal_reaches_the_program_once(tmp_path: Path) -> None:
    marker = tmp_path / "ints"
    with launched(COUNTING.format(marker=str(marker))) as term:
        _program_pid(term)
        time.sleep(0.3)
        term.type(b"\x03")
        deadline = time.monotonic() + REACT_S
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a second, forwarded copy would arrive in this time
        term.type(b"quit\n")
        assert term.wait(REACT_S) == 0, term.output
        assert marker.read_text() == "INT\n"


ECHO = """
    import os
    print("READY", os.getpid(), flush=True)
    while (line := input()) != "quit":
        print("ECHO", line, flush=True)
"""


@pytest.mark.parametrize("how", ["kill", "ctrl-z"])
def test_stop_stops_program_and_wrapper_and_cont_resumes_both(how: str) -> None:
    with launched(ECHO) as term:
        pid = _program_pid(term)
        term.type(b"before\n")
        term.expect(b"ECHO before")
        if how == "kill":
            os.kill(term.pid, signal.SIGTSTP)
        else:
            term.type(b"\x1a")
        _wait_state(pid, stopped=True, what="the program")
        _wait_state(term.pid, stopped=True, what="python -m launch")
        os.kill(term.pid, signal.SIGCONT)
        _wait_state(term.pid, stopped=False, what="python -m launch")
        _wait_state(pid, stopped=False, what="the program")
        term.type(b"after\n")
        term.expect(b"ECHO after", timeout=REACT_S)
        term.type(b"quit\n")
        assert term.wait(REACT_S) == 0, term.output
