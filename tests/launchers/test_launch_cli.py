"""`python -m launch` and init_process_group() as a single process (no launcher)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from launch import _child
from tests.launchers.procs import REPO, base_env, run_group
from tests.support.process import kill_group

PY = sys.executable
LAUNCH = [PY, "-m", "launch"]


def test_exit_status_of_the_program_is_propagated() -> None:
    done = run_group([*LAUNCH, "--", PY, "-c", "raise SystemExit(7)"], base_env(), timeout=60)
    assert done.returncode == 7, done.output


def test_program_killed_by_a_signal_kills_the_launcher_with_it() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    done = run_group([*LAUNCH, "--", PY, "-c", code], base_env(), timeout=60)
    assert done.returncode == -signal.SIGTERM, done.output


def test_signal_to_the_launcher_is_forwarded_to_the_program(tmp_path: Path) -> None:
    marker = tmp_path / "got-sigterm"
    program = textwrap.dedent(
        f"""
        import os, signal, sys, time
        def on_term(*_):
            open({str(marker)!r}, "w").close()
            sys.exit(5)
        signal.signal(signal.SIGTERM, on_term)
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(30)
        """
    )
    done = run_group([*LAUNCH, "--", PY, "-c", program], base_env(), timeout=60)
    assert marker.exists(), done.output
    assert done.returncode == 5, done.output


def test_program_starts_in_its_own_group_with_nothing_run_between_fork_and_exec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A preexec_fn runs Python (ctypes, dlopen) in a child forked while the prefetch's
    # threads may hold locks; subprocess's own process_group= is done in C.
    calls: list[dict[str, Any]] = []
    real = subprocess.Popen

    def spy(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    status = _child.run([PY, "-c", "raise SystemExit(3)"], base_env(), terminal=False)
    assert status == 3
    # The watcher of PROGRAM's group (a session of its own), then PROGRAM.
    assert len(calls) == 2
    assert all(call.get("preexec_fn") is None for call in calls)
    watcher, program = calls
    assert watcher.get("start_new_session") is True
    assert program.get("process_group") == 0


def test_program_gets_sigpipe_and_sigxfsz_at_their_defaults() -> None:
    # Python ignores both at start-up; PROGRAM must not inherit that from the wrapper.
    done = run_group([*LAUNCH, "--", "cat", "/proc/self/status"], base_env(), timeout=60)
    assert done.returncode == 0, done.output
    ignored = int(next(line.split()[1] for line in done.output.splitlines()
                       if line.startswith("SigIgn:")), 16)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not ignored & (1 << (sig - 1)), (sig.name, done.output)


def test_program_dies_with_a_killed_wrapper(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    proc = subprocess.Popen([*LAUNCH, "--", PY, "-c", code], env=base_env(), cwd=REPO,
                            start_new_session=True)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "the program did not start within 60s"
            assert proc.poll() is None, f"python -m launch exited {proc.returncode}"
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, f"the program (pid {pid}) outlived its wrapper"
            time.sleep(0.05)
    finally:
        kill_group(proc)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2] != "Z"
    return False


def test_bad_usage_is_one_line_and_non_zero() -> None:
    for args in ([], ["--bogus", "--", "true"], ["--prefetch", "/nonexistent/manifest", "--", "true"]):
        done = run_group([*LAUNCH, *args], base_env(), timeout=60)
        assert done.returncode == 2, done.output
        assert len(done.output.strip().splitlines()) == 1, done.output
        assert done.output.startswith("python -m launch: error:"), done.output


def test_missing_program_is_reported_with_127() -> None:
    done = run_group([*LAUNCH, "--", "/nonexistent/program"], base_env(), timeout=60)
    assert done.returncode == 127
    assert "cannot run" in done.output


def test_conflicting_launcher_variables_are_a_usage_error() -> None:
    env = base_env(RANK="1", WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_SIZE="4")
    done = run_group([*LAUNCH, "--", "true"], env, timeout=60)
    assert done.returncode == 2
    assert "RANK=1" in done.output and "OMPI_COMM_WORLD_RANK=2" in done.output


def test_exports_torchrun_variables_pool_workspace_and_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "checksums.txt"
    manifest.write_text("")
    show = (
        "import os; print(' '.join(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
        "'MASTER_ADDR', 'DISTCACHE_POOL', 'DISTCACHE_WORKSPACE', 'DISTCACHE_PREFETCH_MANIFEST')))"
    )
    done = run_group(
        [*LAUNCH, "--pool", str(tmp_path / "pool"), "--workspace", str(tmp_path / "ws"),
         "--prefetch", str(manifest), "--", PY, "-c", show],
        base_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.output
    # The last line is the program's; rank 0's prefetch phase lines come before it.
    assert done.output.splitlines()[-1].split() == [
        "0", "1", "0", "127.0.0.1", str(tmp_path / "pool"), str(tmp_path / "ws" / "rank-0"), str(manifest)
    ]


SINGLE = textwrap.dedent(
    """
    import torch, torch.distributed as d, launch
    try:
        launch.gloo_group()
    except launch.LaunchError as exc:
        print("BEFORE", type(exc).__name__)
    info = launch.init_process_group()
    again = launch.init_process_group()  # adopts, does not re-initialise
    t = torch.ones(1)
    d.all_reduce(t, group=launch.gloo_group())
    print("INFO", info.launcher, info.rank, info.world_size, again.world_size, int(t.item()))
    d.destroy_process_group()
    """
)


def test_init_process_group_as_a_single_process_and_adopts_when_called_again() -> None:
    done = run_group([PY, "-c", SINGLE], base_env(), timeout=120)
    assert done.returncode == 0, done.output
    assert "BEFORE LaunchError" in done.output
    assert "INFO single 0 1 1 1" in done.output
