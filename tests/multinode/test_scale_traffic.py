"""Per-rank collective traffic that does not grow with the job, under ``mpirun``.

8 simulated nodes, each with its own pool holding the whole set, run at 1 and at 2
ranks per node (8 and 16 ranks). A counting communicator
(:class:`distcache.comm.CountingCommunicator`) adds up the bytes each rank sends and
receives in a warm prefetch (agreement, sharing proof, discovery, planning, the
report) and in ``sync``: without a state (the public ``distcache.sync``; the pool's
first sync ever, then a second), at a session's first sync and at a later one.
Counted, never timed.

The same launches with a node id per rank (``--flat``: nothing to aggregate per node)
are the baseline: there what a rank receives doubles from 8 to 16 ranks, which is what
this test would see if the collectives all-gathered per-rank lists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from distcache.testing import make_artifacts
from tests.support.helpers import mpi_env, mpirun, run_group

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "traffic_worker.py"
NODES = 8
LAUNCH_TIMEOUT_S = 300.0
STEPS = ("prefetch", "sync_without_state", "second_sync_without_state", "first_sync", "sync")
#: What a rank of a 2-rank node may move beyond a 1-rank node's rank, per step: the
#: other member's own payloads at the node's leader (a few hundred bytes per
#: all-gather of the step) and nothing that depends on the ranks elsewhere.
SLACK = 4096


def launch(tmp: Path, per_node: int, *, flat: bool = False) -> list[dict[str, Any]]:
    out = tmp / f"out-{per_node}-{'flat' if flat else 'tree'}"
    pools = tmp / f"pools-{per_node}-{'flat' if flat else 'tree'}"
    cmd = [mpirun(), "--oversubscribe", "-n", str(NODES * per_node), sys.executable,
           str(WORKER), "--per-node", str(per_node), "--pools", str(pools),
           "--set", str(tmp / "set"), "--out", str(out)]
    if flat:
        cmd.append("--flat")
    done = run_group(cmd, timeout=LAUNCH_TIMEOUT_S, env=mpi_env(), cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(figures) == NODES * per_node
    return figures


def largest(figures: list[dict[str, Any]], step: str, what: str) -> int:
    return max(f[step][what] for f in figures)


@pytest.mark.slow
def test_per_rank_traffic_at_16_ranks_is_that_at_8_plus_a_constant(tmp_path: Path) -> None:
    make_artifacts(tmp_path / "set", 64, min_size=200, max_size=2_000)
    one, two = launch(tmp_path, 1), launch(tmp_path, 2)
    for step in STEPS:
        received_8, received_16 = largest(one, step, "received"), largest(two, step, "received")
        sent_8, sent_16 = largest(one, step, "sent"), largest(two, step, "sent")
        assert received_16 <= received_8 + SLACK, (step, received_8, received_16)
        # A node's leader sends its node the answer a rank of the 8-rank job received.
        assert sent_16 <= sent_8 + received_8 + SLACK, (step, sent_8, sent_16)
    # The pool keeps the journal cursor: only a pool's first sync ever sends its whole
    # journal; a later sync without a state, and a session's first sync, cost what a
    # session's later sync does.
    for figures in (one, two):
        later = largest(figures, "sync", "received")
        assert largest(figures, "sync_without_state", "received") > later + SLACK
        for step in ("second_sync_without_state", "first_sync"):
            assert largest(figures, step, "received") == later, step


@pytest.mark.slow
def test_without_node_aggregation_what_a_rank_receives_grows_with_the_ranks(
        tmp_path: Path) -> None:
    make_artifacts(tmp_path / "set", 64, min_size=200, max_size=2_000)
    one, two = launch(tmp_path, 1, flat=True), launch(tmp_path, 2, flat=True)
    received_8, received_16 = (largest(one, "prefetch", "received"),
                               largest(two, "prefetch", "received"))
    assert received_16 >= 1.8 * received_8
    assert received_16 > received_8 + SLACK
