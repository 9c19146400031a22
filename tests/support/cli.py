"""Running the ``distcache`` command as a user does: a child process with no
``DISTCACHE_*`` settings, a private cache home and this checkout on its path."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli_env(tmp_path: Path) -> dict[str, str]:
    """The environment: this one without ``DISTCACHE_*``, ``XDG_CACHE_HOME`` under
    ``tmp_path``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    clean.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO)})
    return clean


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m distcache ARGS`` in its own session, killed after 120 s."""
    return subprocess.run([sys.executable, "-m", "distcache", *args], capture_output=True,
                          text=True, env=env, timeout=120, start_new_session=True, check=False)


def signal_mid_download(args: list[str], env: dict[str, str], pool: Path,
                        sig: int, again: float | None = None) -> tuple[int, float, str]:
    """Run ``args`` in a session of its own, send ``sig`` once its downloads write into
    ``pool``'s ``tmp/`` (0.3 s after the first temporary file shows), and ``again``
    seconds later once more (an impatient second Ctrl-C), and return its exit status,
    the seconds from the signal to its exit, and its stderr. Killed (group and all) if
    it does not end within a minute of the signal."""
    import signal
    import time

    # A shell starts background jobs with SIGINT ignored, and an ignored signal stays
    # ignored across exec (the test command runs the suite that way): give the command
    # the disposition a terminal's Ctrl-C meets. A handler of this process becomes the
    # default in the child.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        deadline = time.monotonic() + 60
        while not ((pool / "tmp").is_dir() and any((pool / "tmp").iterdir())):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no download started"
            time.sleep(0.01)
        time.sleep(0.3)  # well into the downloads
        sent = time.monotonic()
        proc.send_signal(sig)
        if again is not None:
            time.sleep(again)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
        return proc.returncode, time.monotonic() - sent, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_read_only(env: dict[str, str], directory: Path,
                  argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with ``directory`` bind-mounted read-only in a private mount
    namespace (the tests run as root, whom chmod does not stop), killed after 120 s;
    skips the test where ``unshare --mount`` is not allowed."""
    import shlex
    import shutil

    import pytest

    if shutil.which("unshare") is None or subprocess.run(
        ["unshare", "--mount", "true"], capture_output=True, check=False
    ).returncode != 0:
        pytest.skip("needs unshare --mount (root, CAP_SYS_ADMIN) for a read-only bind mount")
    where = shlex.quote(str(directory))
    script = (f"mount --bind {where} {where} && mount -o remount,ro,bind {where} "
              f"&& exec {shlex.join(argv)}")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
