"""Running the ``distcache`` command as a user does: a child process with no
``DISTCACHE_*`` settings, a private cache home and this checkout on its path."""

from __future__ import annotations

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
