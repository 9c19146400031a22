"""Fixtures for multi-"node" tests: several launches on one machine, each with its own
``DISTCACHE_NODE_ID``, under a hard timeout that kills the whole process group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from tests.support.helpers import mpi_env, mpmd_command, run_group

#: Seconds any one multi-process launch may take before its process group is killed.
LAUNCH_TIMEOUT_S = 120.0


@pytest.fixture
def run_mpmd() -> Callable[..., CompletedProcess[str]]:
    """``run_mpmd([(nprocs, env, argv), ...])``: one MPMD ``mpirun`` launch.

    Each application context gets its own ``-x`` variables (see
    :func:`tests.support.helpers.mpmd_command`).
    """

    def run(
        contexts: Sequence[tuple[int, dict[str, str], Sequence[str]]],
        *,
        timeout: float = LAUNCH_TIMEOUT_S,
        cwd: Path | None = None,
    ) -> CompletedProcess[str]:
        return run_group(mpmd_command(contexts), timeout=timeout, env=mpi_env(), cwd=cwd)

    return run
