"""Run real launchers (mpirun, torchrun, srun) in their own sessions, under hard timeouts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import helpers

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROGRAM = Path(__file__).with_name("allreduce_prog.py")
PY = sys.executable
#: Four ranks under this environment's Open MPI; append the program's argv.
MPIRUN_4 = [str(BIN / "mpirun"), "-n", "4", "--oversubscribe"]
#: Four ranks under torchrun on this machine; append the script and its arguments.
TORCHRUN_4 = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4"]
#: Four ranks under srun on the one-node Slurm of the ``slurm_env`` fixture.
SRUN_4 = ["srun", "-n", "4", "--time=5"]
#: ``python -m launch``; append its options, ``--`` and the program.
LAUNCH = [PY, "-m", "launch"]


_RESULT = re.compile(r"RESULT (\S+?) (\d+) (\d+) (\d+)(?=RESULT|\s|$)")


@dataclass
class Result:
    returncode: int
    output: str

    def results(self) -> list[tuple[str, int, int, int]]:
        """The ``RESULT launcher rank world sum`` lines, sorted by rank."""
        # Ranks share one pipe, so a line may be glued to another rank's line.
        rows = [
            (launcher, int(rank), int(world), int(total))
            for launcher, rank, world, total in _RESULT.findall(self.output)
        ]
        return sorted(rows, key=lambda row: row[1])


def as_on_a_terminal() -> None:
    """A ``preexec_fn``: SIGINT and SIGQUIT at their defaults, as a shell on a terminal
    leaves them. The suite may run as a shell's background job, which has them ignored,
    and the wrapper keeps a signal ignored on entry ignored (as the program would)."""
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in list(env):
        # The test process may itself run under a launcher; its variables must not leak.
        if name.startswith(
            ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
        ) or name in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "DISTCACHE_NODE_ID",
        ):
            del env[name]
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]),
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def run_group(cmd: Sequence[str], env: dict[str, str], timeout: float = 120) -> Result:
    """Run ``cmd`` from the checkout under :func:`tests.support.helpers.run_group`, stderr merged
    into the output; fail the test if it runs past ``timeout``."""
    try:
        done = helpers.run_group(cmd, timeout=timeout, env=env, cwd=REPO, merge_stderr=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} exceeded {timeout}s and was killed; output:\n{exc.output}")
    return Result(done.returncode, done.stdout)
