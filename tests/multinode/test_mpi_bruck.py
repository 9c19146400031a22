"""All-gathers on a large MPI communicator go point to point, under ``mpirun -n 20``.

Above ``BRUCK_ABOVE`` ranks distcache's MPI backend all-gathers in log2(N) rounds of
point-to-point messages (Bruck's algorithm) rather than the MPI library's non-blocking
all-gather, which is linear in Open MPI. The worker checks every rank's result against
what each rank sent (payloads of different sizes, empty ones, nested objects, after a
split), and that a rank that never arrives makes the others time out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from distcache.comm._mpi import BRUCK_ABOVE
from tests.support.helpers import mpi_env, mpirun, run_group

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "bruck_worker.py"
RANKS = 20


@pytest.mark.slow
def test_a_large_communicator_all_gathers_point_to_point_and_still_times_out(
    tmp_path: Path,
) -> None:
    assert RANKS > BRUCK_ABOVE
    out = tmp_path / "out"
    cmd = [mpirun(), "--oversubscribe", "-n", str(RANKS), sys.executable, str(WORKER),
           "--out", str(out)]
    done = run_group(cmd, timeout=300.0, env=mpi_env(), cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(ranks) == RANKS
    for seen in ranks:
        assert seen["bruck"] and seen["right"], seen
        if seen["rank"] != RANKS - 1:
            assert seen["timeout"] == "CollectiveTimeout", seen
            assert seen["timeout_s"] < 30, seen
