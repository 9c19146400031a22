"""Fixtures for the launcher tests: a one-node Slurm started once per session."""

from __future__ import annotations

import pytest

from tests.launchers.procs import REPO, base_env, run_group


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """A running one-node Slurm (started by scripts/slurm_up.sh); the env to reach it."""
    script = REPO / "scripts" / "slurm_up.sh"
    done = run_group(["bash", str(script)], base_env(), timeout=600)
    if done.returncode != 0:
        pytest.fail(f"scripts/slurm_up.sh failed (rc {done.returncode}):\n{done.output}")
    lines = [ln for ln in done.output.splitlines() if ln.startswith("SLURM_CONF=")]
    if not lines:
        pytest.fail(f"scripts/slurm_up.sh printed no SLURM_CONF:\n{done.output}")
    return base_env(SLURM_CONF=lines[-1].split("=", 1)[1])
