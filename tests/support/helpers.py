"""Helpers shared by the test suites: MPI environments and command lines, and (from
:mod:`tests.support.process`) running a command tree under a hard timeout.

Every multi-process test starts its children in a new session (so they form one
process group) and kills the whole group when the time is up, so a rank that hangs
fails the test instead of the run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.process import kill_group, mpirun, run_group

__all__ = ["kill_group", "mpi_env", "mpirun", "mpmd_command", "run_group"]


def mpi_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """An environment in which ``mpirun`` may run as root and oversubscribe cores."""
    env = dict(os.environ if base is None else base)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        PYTHONDONTWRITEBYTECODE="1",
    )
    # Children must import this checkout, whatever the caller's working directory.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def mpmd_command(
    contexts: Sequence[tuple[int, Mapping[str, str], Sequence[str | os.PathLike[str]]]],
) -> list[str]:
    """One MPMD ``mpirun`` command line from ``(nprocs, variables, argv)`` contexts.

    Each application context gets its own ``-x`` variables, which is how one machine
    stands in for several nodes (a ``DISTCACHE_NODE_ID`` per context).
    """
    cmd = [mpirun(), "--oversubscribe"]
    for index, (nprocs, variables, argv) in enumerate(contexts):
        if index:
            cmd.append(":")
        cmd += ["-n", str(nprocs)]
        for key, value in variables.items():
            cmd += ["-x", f"{key}={value}"]
        cmd += [os.fspath(arg) for arg in argv]
    return cmd
