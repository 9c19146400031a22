"""Fixtures for the launcher tests: a one-node Slurm started once per session."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.launchers.procs import REPO, base_env
from tests.support import helpers

SLURM_UP = REPO / "scripts" / "slurm_up.sh"
SLURM_DOWN = REPO / "scripts" / "slurm_down.sh"
#: Seconds allowed to start Slurm (a first start may install packages).
SLURM_UP_TIMEOUT_S = 600


def started_daemons(output: str) -> list[str]:
    """The daemons ``slurm_up.sh`` says it started (its ``STARTED <daemon>`` lines)."""
    return [line.split()[1] for line in output.splitlines()
            if line.startswith("STARTED ") and len(line.split()) == 2]


def stop_daemons(daemons: list[str], env: dict[str, str]) -> None:
    """Stop ``daemons`` (names ``slurm_up.sh`` printed) through ``slurm_down.sh``."""
    done = helpers.run_group(["bash", str(SLURM_DOWN), *daemons], timeout=60, env=env,
                             cwd=REPO, merge_stderr=True)
    if done.returncode != 0:
        pytest.fail(f"scripts/slurm_down.sh {' '.join(daemons)} failed "
                    f"(rc {done.returncode}):\n{done.stdout}")


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """A running one-node Slurm (started by scripts/slurm_up.sh); the env to reach it.

    When the session ends, pass or fail, the daemons this session started are stopped;
    daemons that were already running before it are left running.
    """
    env = base_env()
    try:
        done = helpers.run_group(["bash", str(SLURM_UP)], timeout=SLURM_UP_TIMEOUT_S,
                                 env=env, cwd=REPO, merge_stderr=True)
        output, returncode = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, returncode = exc.output or "", None
    started = started_daemons(output)
    try:
        if returncode is None:
            pytest.fail(f"scripts/slurm_up.sh exceeded {SLURM_UP_TIMEOUT_S}s:\n{output}")
        if returncode != 0:
            pytest.fail(f"scripts/slurm_up.sh failed (rc {returncode}):\n{output}")
        lines = [ln for ln in output.splitlines() if ln.startswith("SLURM_CONF=")]
        if not lines:
            pytest.fail(f"scripts/slurm_up.sh printed no SLURM_CONF:\n{output}")
        yield base_env(SLURM_CONF=lines[-1].split("=", 1)[1])
    finally:
        if started:
            stop_daemons(started, env)
