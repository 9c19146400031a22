"""What PROGRAM leaves running in its process group ends with it under `python -m launch`.

A launcher ends a rank by signalling the rank's process group; PROGRAM runs in a group
of its own, so what it started there is ended by the wrapper once PROGRAM has exited.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

from launch import _child, _watch
from tests.launchers.procs import LAUNCH, PY, REPO, base_env
from tests.support.process import kill_group

#: PROGRAM: starts a child in its own group that writes its pid, then (on SIGTERM)
#: a marker if it handles TERM; PROGRAM then exits with status 3, or waits.
_PROGRAM = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {child!r}])
deadline = time.monotonic() + 30
while not os.path.exists({pidfile!r}) and time.monotonic() < deadline:
    time.sleep(0.02)
if {wait_for_term}:
    time.sleep(60)
sys.exit(3)
"""

_CHILD = """
import os, signal, time
def on_term(*_):
    open({marker!r}, "w").close()
    {on_term}
signal.signal(signal.SIGTERM, on_term)
with open({pidfile!r} + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename({pidfile!r} + ".tmp", {pidfile!r})
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2] != "Z"
    return False


def _start(tmp_path: Path, *, on_term: str, wait_for_term: bool
           ) -> tuple[subprocess.Popen[bytes], Path, Path]:
    pidfile, marker = tmp_path / "child.pid", tmp_path / "got-term"
    child = textwrap.dedent(_CHILD).format(marker=str(marker), pidfile=str(pidfile),
                                           on_term=on_term)
    program = textwrap.dedent(_PROGRAM).format(child=child, pidfile=str(pidfile),
                                               wait_for_term=wait_for_term)
    proc = subprocess.Popen([*LAUNCH, "--", PY, "-c", program], env=base_env(), cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the program's child did not start within 60s"
        assert proc.poll() is None, proc.communicate()[0].decode()
        time.sleep(0.05)
    return proc, pidfile, marker


def _finish(proc: subprocess.Popen[bytes], pid: int) -> tuple[int, str]:
    try:
        output = proc.communicate(timeout=60)[0].decode()
        return proc.returncode, output
    finally:
        kill_group(proc)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_child_left_running_gets_sigterm_when_the_program_exits(tmp_path: Path) -> None:
    proc, pidfile, marker = _start(tmp_path, on_term="raise SystemExit(0)",
                                   wait_for_term=False)
    pid = int(pidfile.read_text())
    status, output = _finish(proc, pid)
    assert status == 3, output  # the program's own status
    assert marker.exists(), output  # asked first, and it could clean up
    assert not _alive(pid), output
    assert "left processes running in its group" in output


def test_a_child_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc, pidfile, marker = _start(tmp_path, on_term="pass", wait_for_term=False)
    pid = int(pidfile.read_text())
    status, output = _finish(proc, pid)
    assert status == 3, output
    assert marker.exists(), output  # it was sent SIGTERM and ignored it
    assert not _alive(pid), output


def test_a_job_shut_down_kills_what_ignores_the_forwarded_sigterm(tmp_path: Path) -> None:
    # The launcher's SIGTERM reaches the wrapper, which passes it on to PROGRAM's
    # group; PROGRAM dies of it, its child ignores it and must not outlive the rank.
    proc, pidfile, marker = _start(tmp_path, on_term="pass", wait_for_term=True)
    pid = int(pidfile.read_text())
    os.kill(proc.pid, signal.SIGTERM)
    status, output = _finish(proc, pid)
    assert status == -signal.SIGTERM, output
    assert marker.exists(), output
    assert not _alive(pid), output
    assert "still runs after it ended: killing it" in output


def test_nothing_left_means_no_clean_up() -> None:
    done = subprocess.run([*LAUNCH, "--", PY, "-c", "raise SystemExit(4)"], env=base_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 4, done.stderr
    assert "left processes" not in done.stderr and "still runs" not in done.stderr


def test_a_zombie_left_in_the_group_does_not_count_as_running() -> None:
    # A child that exited but that nobody reaped stays in the process table (and in
    # its group) as a zombie; the clean-up must not wait the grace out for it.
    child = subprocess.Popen([PY, "-c", "pass"], process_group=0)
    try:
        deadline = time.monotonic() + 30
        while _alive(child.pid):
            assert time.monotonic() < deadline, "the child did not exit within 30s"
            time.sleep(0.02)
        assert Path(f"/proc/{child.pid}").exists()  # a zombie, not yet reaped
        assert not _child._running_in(child.pid)
    finally:
        child.wait()
    assert not _child._running_in(child.pid)  # and the group is gone once reaped
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"], process_group=0)
    try:
        assert _child._running_in(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def _watchers_of(wrapper: int) -> list[int]:
    """The wrapper's watcher processes (children of ``wrapper`` named as the watcher)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if (int(stat[stat.rindex(")") + 2:].split()[1]) == wrapper
                    and _watch.WATCHER_NAME.encode() in argv):
                found.append(int(entry.name))
    return found


def test_a_wrapper_killed_outright_takes_what_the_program_started(tmp_path: Path) -> None:
    # torchrun ends a rank by signalling the wrapper's group and, when that is not
    # enough, by SIGKILL: the wrapper cannot act then, and PROGRAM dies with it; what
    # PROGRAM started (ignoring SIGTERM) must not outlive the rank either.
    proc, pidfile, _ = _start(tmp_path, on_term="pass", wait_for_term=True)
    pid = int(pidfile.read_text())
    try:
        assert os.getpgid(pid) != os.getpgid(proc.pid)  # out of the wrapper's group
        watchers = _watchers_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(pid):
            assert time.monotonic() < deadline, "the program's child outlived the wrapper"
            time.sleep(0.05)
        while any(_alive(w) for w in watchers):
            assert time.monotonic() < deadline, "the watcher outlived the wrapper"
            time.sleep(0.05)
    finally:
        _finish(proc, pid)


def test_the_watcher_ends_with_the_wrapper_and_kills_nothing(tmp_path: Path) -> None:
    # A clean run: the watcher is told the wrapper is done and leaves, killing nothing
    # (a process outside the program's group, started by the test, is untouched).
    go = tmp_path / "go"
    program = ("import os, time\n"
               f"while not os.path.exists({str(go)!r}):\n"
               "    time.sleep(0.02)\n"
               "raise SystemExit(5)\n")
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])
    proc = subprocess.Popen([*LAUNCH, "--", PY, "-c", program], env=base_env(), cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (watchers := _watchers_of(proc.pid)):
            assert time.monotonic() < deadline, "no watcher within 60s"
            assert proc.poll() is None, proc.communicate()[0].decode()
            time.sleep(0.05)
        [watcher] = watchers
        assert os.getsid(watcher) == watcher != os.getsid(proc.pid)  # its own session
        go.touch()
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == 5, output
        assert not any(_alive(w) for w in watchers), output  # gone with the wrapper
        assert bystander.poll() is None
    finally:
        kill_group(proc)
        bystander.kill()
        bystander.wait()
