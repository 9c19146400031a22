"""Run PROGRAM as the launch wrapper's child, the way a shell runs a job.

- **Its own process group.** A signal the wrapper forwards reaches PROGRAM and what
  it started, once: a launcher that signals the wrapper's group does not reach
  PROGRAM a second time behind the wrapper's back.
- **The terminal.** When the wrapper is the foreground group of its controlling
  terminal (typed at a shell), PROGRAM's group is made the foreground group, so
  ``input()`` and ``breakpoint()`` read the terminal instead of stopping on SIGTTIN,
  and Ctrl-C, Ctrl-\\ and Ctrl-Z reach PROGRAM directly. The wrapper takes the
  terminal back when PROGRAM stops or exits. Under mpirun, srun and torchrun the
  wrapper is not the foreground group (or has no terminal), and nothing changes.
- **Job control.** INT, TERM, HUP, QUIT, USR1, USR2, TSTP and CONT sent to the wrapper
  are forwarded, and so is every other signal that would end it (:data:`FORWARDED`). When PROGRAM stops on a job-control stop (TSTP, TTIN, TTOU), the
  wrapper stops too (so the shell sees the job stopped); when the wrapper is continued,
  so is PROGRAM. A SIGSTOP sent to PROGRAM itself does not stop the wrapper, which
  then still sees PROGRAM continued (by whoever) and its exit. A signal that ends PROGRAM
  is followed by SIGCONT when PROGRAM is stopped, or a handler would never run; also
  when PROGRAM's stop is reported only after the signal, which then waits on it.
- **Nothing between fork and exec** but subprocess's own C code (``process_group=``):
  the wrapper may hold threads (the prefetch's), and a ``preexec_fn`` calling into
  ``ctypes`` there may deadlock. Dying with the wrapper (``PR_SET_PDEATHSIG``) is set
  by a small exec shim instead: a fresh interpreter that sets it and execs PROGRAM
  under the same process id.
- **Nothing left behind.** What PROGRAM started in its group ends with it, as a
  launcher ends a rank's group: once PROGRAM has exited, any process still in its
  group gets SIGTERM and, :data:`GRACE_S` later, SIGKILL; at once SIGKILL where
  PROGRAM ended by a signal the wrapper had passed on, or exited with 128 plus it (the
  launcher is shutting the job down and may kill the wrapper next). A wrapper killed outright (SIGKILL)
  cannot do this itself: PROGRAM dies with it (``PR_SET_PDEATHSIG``), and what
  PROGRAM started is killed by a watcher (:mod:`launch._watch`), a ``/bin/sh`` in a session
  of its own (out of reach of a signal sent to the wrapper's group) that kills
  PROGRAM's group when the wrapper is gone without having said that it is done.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from distcache._log import get_logger
from launch._watch import Watcher

log = get_logger(__name__)

#: Signals sent to the wrapper that are passed on to PROGRAM's process group: job
#: control, and every signal sent from outside whose default action would end the
#: wrapper (Slurm's USR1 before a time limit, a batch system's XCPU at a CPU limit,
#: PWR on a power event, timers' ALRM, VTALRM and PROF, IO, the real-time signals).
#: Faults (SEGV, BUS, ILL, FPE, ABRT, SYS, TRAP) are not: a wrapper killed by one takes
#: PROGRAM with it (``PR_SET_PDEATHSIG``, :mod:`launch._watch`).
FORWARDED: tuple[int, ...] = (
    signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
    signal.SIGUSR2, signal.SIGTSTP, signal.SIGCONT, signal.SIGALRM, signal.SIGVTALRM,
    signal.SIGPROF, signal.SIGXCPU, signal.SIGPWR, signal.SIGIO,
    *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
)
#: Signals that usually end PROGRAM: a stopped PROGRAM is continued after them.
_ENDING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
#: Stops the kernel discards for an orphaned process group (POSIX job control).
_JOB_STOPS = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})

#: Seconds a process PROGRAM left in its group has, after SIGTERM, before SIGKILL.
GRACE_S = 3.0

#: argv: ``-c SHIM WRAPPER_PID PROGRAM [ARGS...]``. The interpreter's start-up
#: ignores SIGPIPE and SIGXFSZ; PROGRAM gets them at their defaults, as subprocess
#: gives them. Exit 127 / 126 as a shell does when PROGRAM cannot be run.
SHIM = """\
import os, signal, sys
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
except (ImportError, OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
argv = sys.argv[2:]
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"python -m launch: error: cannot run {argv[0]!r}: {exc.strerror or exc}\\n")
    os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
"""


def shim_command(command: Sequence[str]) -> list[str]:
    """The argv that runs ``command`` through :data:`SHIM`."""
    return [sys.executable, "-I", "-S", "-c", SHIM, str(os.getpid()), *command]


def _controlling_terminal() -> int | None:
    try:
        return os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None  # no controlling terminal: a daemon, a launcher's new session


@contextlib.contextmanager
def _ttou_blocked() -> Iterator[None]:
    # tcsetpgrp from a background group raises SIGTTOU (which stops us) unless
    # SIGTTOU is blocked or ignored; blocked, the call simply succeeds.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _stop_signal_for_self(sig: int) -> int:
    """``sig`` if it will stop this process, else SIGSTOP.

    The kernel discards TSTP, TTIN and TTOU for an orphaned process group (one whose
    members have no parent in another group of the same session, i.e. no shell to
    continue it); SIGSTOP always stops. The group is certainly not orphaned when our
    parent is in another group of our session, which is how a shell starts a job.
    """
    if sig not in _JOB_STOPS:
        return signal.SIGSTOP
    try:
        parent = os.getppid()
        if os.getsid(parent) == os.getsid(0) and os.getpgid(parent) != os.getpgrp():
            return sig
    except OSError:
        pass
    return signal.SIGSTOP


class _Job:
    def __init__(self, command: Sequence[str], env: dict[str, str], terminal: bool) -> None:
        self.command = list(command)
        self.env = env
        self.tty = _controlling_terminal() if terminal else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []
        self.stopped = False
        self.ending = False  # a signal that ends PROGRAM was passed on to its group

    # -- the terminal ---------------------------------------------------------------

    def _foreground(self) -> int | None:
        if self.tty is None:
            return None
        try:
            return os.tcgetpgrp(self.tty)
        except OSError:
            return None

    def _give_terminal(self) -> None:
        """Make PROGRAM's group the terminal's foreground group, if it is ours now."""
        if self.proc is None or self.tty is None or self._foreground() != os.getpgrp():
            return
        with _ttou_blocked(), contextlib.suppress(OSError):
            os.tcsetpgrp(self.tty, self.proc.pid)
            log.debug("gave the terminal to PROGRAM's process group %d", self.proc.pid)

    def _take_terminal(self) -> None:
        """Make our group the foreground group again, if PROGRAM's group has it."""
        if self.proc is None or self.tty is None or self._foreground() != self.proc.pid:
            return
        with _ttou_blocked(), contextlib.suppress(OSError):
            os.tcsetpgrp(self.tty, os.getpgrp())

    # -- signals --------------------------------------------------------------------

    def _signal_child(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def _resume(self) -> None:
        self._give_terminal()
        self.stopped = False
        self._signal_child(signal.SIGCONT)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.proc is None:
            self.pending.append(signum)  # arrived while starting: delivered right after
            return
        if signum == signal.SIGCONT:
            self._resume()
            return
        self._signal_child(signum)
        self.ending = self.ending or signum in _ENDING
        if signum in _ENDING and self.stopped:
            self._signal_child(signal.SIGCONT)
            self.stopped = False

    def _child_stopped(self, sig: int) -> None:
        assert self.proc is not None
        self.stopped = True
        if self.ending and _ending_pending(self.proc.pid):
            # An ending signal passed on found PROGRAM stopped before its stop was
            # reported, and waits there: continued, PROGRAM handles it.
            self._signal_child(signal.SIGCONT)
            self.stopped = False
            return
        if sig not in _JOB_STOPS:
            # SIGSTOP, which no terminal sends: a person or a debugger stopped PROGRAM
            # itself and continues it the same way. Stopped with it, the wrapper would
            # see neither that nor PROGRAM's exit, and its launcher would wait on it.
            return
        if sig in (signal.SIGTTIN, signal.SIGTTOU) and self.tty is not None:
            owner = self._foreground()
            if owner == self.proc.pid:
                # It read before the handover completed: it owns the terminal now.
                self._resume()
                return
            if owner == os.getpgrp():
                self._resume()  # we became the foreground (fg): pass it on
                return
        self._take_terminal()
        own = _stop_signal_for_self(sig)
        previous = signal.signal(own, signal.SIG_DFL) if own != signal.SIGSTOP else None
        try:
            signal.raise_signal(own)  # returns once we are continued
        finally:
            if previous is not None:
                signal.signal(own, previous)
        if self.stopped:  # the SIGCONT handler has not run yet
            self._resume()

    # -- the run --------------------------------------------------------------------

    def run(self) -> int:
        # A signal ignored on entry (nohup's SIGHUP; SIGINT and SIGQUIT for a shell's
        # background job) stays ignored: PROGRAM inherits the ignore, nothing is passed on.
        previous = {sig: signal.signal(sig, self._on_signal) for sig in FORWARDED
                    if signal.getsignal(sig) != signal.SIG_IGN}
        watcher, ended = Watcher(), False
        try:
            self.proc = subprocess.Popen(shim_command(self.command), env=self.env, process_group=0)
            watcher.watch(self.proc.pid)
            self._give_terminal()
            for signum in self.pending:
                self._on_signal(signum, None)
            status = self._wait(self.proc)
            self._end_group()
            ended = True
            return status
        finally:
            if self.proc is not None and not ended:
                # Leaving by an exception: PROGRAM and its group must not outlive us.
                self._signal_child(signal.SIGKILL)
                if self.proc.returncode is None:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(self.proc.pid, 0)
                    self.proc.returncode = -signal.SIGKILL
            watcher.done()
            self._take_terminal()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.tty is not None:
                os.close(self.tty)

    def _end_group(self) -> None:
        """End what PROGRAM (exited) left running in its group (the module's doc)."""
        assert self.proc is not None
        group = self.proc.pid
        if not _running_in(group):
            return
        code = self.proc.returncode
        if self.ending and code is not None and (-code in _ENDING or code - 128 in _ENDING):
            # It ended by (or exiting for) a signal passed on: the job is being shut down.
            log.warning("PROGRAM's process group %d still runs after it ended: killing it",
                        group)
            self._signal_child(signal.SIGKILL)
            return
        log.warning("PROGRAM exited and left processes running in its group %d: sending "
                    "them SIGTERM, SIGKILL after %g s", group, GRACE_S)
        self._signal_child(signal.SIGTERM)
        self._signal_child(signal.SIGCONT)  # a stopped one would not handle it
        deadline = time.monotonic() + GRACE_S
        while _running_in(group):
            if time.monotonic() >= deadline:
                self._signal_child(signal.SIGKILL)
                return
            time.sleep(0.05)

    def _wait(self, proc: subprocess.Popen[bytes]) -> int:
        while True:
            _, status = os.waitpid(proc.pid, os.WUNTRACED | os.WCONTINUED)
            if os.WIFSTOPPED(status):
                self._child_stopped(os.WSTOPSIG(status))
                continue
            if os.WIFCONTINUED(status):
                self.stopped = False  # by whoever: an ending signal needs no SIGCONT now
                continue
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode


def _ending_pending(pid: int) -> bool:
    """Whether a signal of :data:`_ENDING` waits on process ``pid`` (True where its
    status cannot be read: a needless SIGCONT is the lesser harm)."""
    mask = sum(1 << (sig - 1) for sig in _ENDING)
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & mask:
            return True
    return False


def _running_in(group: int) -> bool:
    """Whether a process of process group ``group`` is running (not a zombie, which an
    init that does not reap would keep in the group for good)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return True  # no process table to read: the group answers, so it runs
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        if len(fields) > 2 and fields[2] == str(group) and fields[0] != "Z":
            return True
    return False


def run(command: Sequence[str], env: dict[str, str], *, terminal: bool = True) -> int:
    """Run ``command`` with signals forwarded; returns its exit status, or ``-SIG``.

    ``terminal``: hand the controlling terminal to PROGRAM when this process is its
    foreground group (False where several wrappers share one group, as local ranks
    of one launcher may, so that they do not take the terminal from each other).
    """
    return _Job(command, env, terminal).run()


def exit_like(status: int) -> NoReturn:
    """Exit as PROGRAM did: with its status, or dying of the signal that killed it."""
    if status < 0:
        # Die of the same signal, so that our parent (mpirun, srun) sees what happened.
        # A signal's default action skips the interpreter's exit: its exit work (the
        # start-up hook's publication of the JIT caches this process owns, among
        # others) runs first, once (the handlers are cleared as they run).
        sig = -status
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if sig != signal.SIGKILL:  # which cannot be caught, nor its handler reset
            signal.signal(sig, signal.SIG_DFL)
        # The program's core (SIGSEGV, SIGABRT) is what shows its crash: never one of
        # this wrapper's in its place, at the same name.
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), sig)
        sys.exit(128 + sig)
    sys.exit(status)
