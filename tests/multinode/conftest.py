"""Fixtures for multi-"node" tests: several launches on one machine, each with its own
``DISTCACHE_NODE_ID``, under a hard timeout that kills the whole process group."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from tests.helpers import mpi_env, mpirun, run_group

#: Seconds any one multi-process launch may take before its process group is killed.
LAUNCH_TIMEOUT_S = 120.0


@pytest.fixture
def run_mpmd() -> Callable[..., CompletedProcess[str]]:
    """``run_mpmd([(nprocs, env, argv), ...])``: one MPMD ``mpirun`` launch.

    Each application context gets its own ``-x`` variables, which is how one machine
    stands in for several nodes.
    """

    def run(
        contexts: Sequence[tuple[int, dict[str, str], Sequence[str]]],
        *,
        timeout: float = LAUNCH_TIMEOUT_S,
        cwd: Path | None = None,
    ) -> CompletedProcess[str]:
        cmd: list[str] = [mpirun(), "--oversubscribe"]
        for i, (nprocs, env, argv) in enumerate(contexts):
            if i:
                cmd.append(":")
            cmd += ["-n", str(nprocs)]
            for key, value in env.items():
                cmd += ["-x", f"{key}={value}"]
            cmd += list(argv)
        return run_group(cmd, timeout=timeout, env=mpi_env(), cwd=cwd)

    return run
