"""A process forked from one with a FlashInfer usage record open (an engine forking
its workers) records into a file of its own, never into its parent's."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from distcache.integrations.flashinfer._record import Recorder, _host, read_record

SHA_A, SHA_B, SHA_C = "a" * 64, "b" * 64, "c" * 64


def _wait_child(pid: int, seconds: float = 15.0) -> int:
    """The exit status of child ``pid``; killed (and a failure) past ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} hung while recording (killed)")


def _fork(work: Callable[[], bool]) -> int:
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            code = 0 if work() else 3
        finally:
            os._exit(code)
    return pid


def test_a_forked_child_records_into_its_own_file(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    assert recorder.add("parent/one.cubin", SHA_A)  # the parent's file is open
    parent_file = recorder.path
    pid = _fork(lambda: recorder.add("child/two.cubin", SHA_B))
    assert _wait_child(pid) == 0
    assert recorder.add("parent/three.cubin", SHA_C)
    recorder.close()
    assert parent_file.read_text() == (f"{SHA_A}  parent/one.cubin\n"
                                       f"{SHA_C}  parent/three.cubin\n")
    others = sorted(p.name for p in tmp_path.glob("*.txt") if p != parent_file)
    assert len(others) == 1 and others[0].startswith(f"{_host()}-{pid}"), others
    assert (tmp_path / others[0]).read_text() == f"{SHA_B}  child/two.cubin\n"
    assert read_record(tmp_path, compact=False) == {
        "parent/one.cubin": SHA_A, "child/two.cubin": SHA_B, "parent/three.cubin": SHA_C}


def test_a_child_forked_while_another_thread_records_does_not_hang(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    assert recorder.add("parent/one.cubin", SHA_A)
    holding, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:  # a thread of the parent in the middle of add()
        with recorder._lock:
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=hold_the_lock, daemon=True)
    thread.start()
    assert holding.wait(10)
    try:
        pid = _fork(lambda: recorder.add("child/two.cubin", SHA_B))
    finally:
        release.set()
        thread.join(10)
    assert _wait_child(pid) == 0
    recorder.close()
    assert read_record(tmp_path, compact=False) == {
        "parent/one.cubin": SHA_A, "child/two.cubin": SHA_B}


def test_a_recorder_with_a_given_file_name_keeps_whole_lines_in_a_forked_child(
    tmp_path: Path,
) -> None:
    recorder = Recorder(tmp_path, file_name="shared.txt")
    assert recorder.add("parent/one.cubin", SHA_A)

    def many() -> bool:
        return all(recorder.add(f"child/{i}.cubin", SHA_B) for i in range(200))

    pid = _fork(many)
    for i in range(200):
        assert recorder.add(f"parent/{i}.cubin", SHA_C)
    assert _wait_child(pid) == 0
    recorder.close()
    lines = (tmp_path / "shared.txt").read_text().splitlines()
    assert len(lines) == 401
    assert all(line in (f"{SHA_B}  child/{i}.cubin", f"{SHA_C}  parent/{i}.cubin")
               or line == f"{SHA_A}  parent/one.cubin"
               for line in lines for i in [line.rsplit("/", 1)[-1].split(".")[0]])
