"""``launch.init_process_group()`` under ``mpirun`` bounds its MPI exchange (host names,
then rank 0's store address) by its timeout: where a rank never calls it, the others
raise :class:`~distcache.errors.CollectiveTimeout` naming the rendezvous, instead of
spinning in a blocking ``MPI_Allgather`` for as long as that rank stays away."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import mpi_env, mpirun
from tests.support.process import run_group

pytestmark = pytest.mark.timeout(300)

_RANK = """
import os, sys, time
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
import launch
from distcache.errors import CollectiveTimeout
if rank == 1:
    # Never calls it: stays away far longer than rank 0's timeout, then leaves.
    time.sleep(float(sys.argv[1]))
    print("rank 1 left without calling", flush=True)
    os._exit(0)
try:
    launch.init_process_group(backend="gloo", timeout=2)
except CollectiveTimeout as exc:
    print("rank 0 CollectiveTimeout:", exc, flush=True)
    os._exit(0)
print("rank 0 returned", flush=True)
os._exit(1)
"""


def test_a_rank_that_never_joins_the_rendezvous_times_the_others_out(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    # Rank 1 stays away 120 s: a rank 0 that waited for it would run the launch past
    # the group's timeout (90 s), which fails the test.
    cmd = [mpirun(), "-n", "2", "--oversubscribe", sys.executable, str(script), "120"]
    try:
        done = run_group(cmd, timeout=90, env=mpi_env(), merge_stderr=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"rank 0 waited for the rank that never came: {exc.output!r}")
    assert "rank 0 CollectiveTimeout: the launch's rendezvous" in done.stdout, done.stdout
    assert "rank 0 returned" not in done.stdout
