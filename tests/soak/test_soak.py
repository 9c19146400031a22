"""Fault-injection soak, CI size: at least 30 fault rounds of collective prefetches
under ``mpirun -n 4`` (origin errors, timeouts, hangs, bad bodies, a full disk,
corrupted, deleted and stale pool files, ranks killed with SIGKILL), each followed
by a clean round, with the invariants of DESIGN.md checked after every round.

``scripts/soak.py --rounds 500`` runs the same machinery for longer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.soak import FAULT_KINDS, SoakConfig, run_soak, tmpfs_available

ROUNDS = 60


# Every round has its own hard deadline (DISTCACHE_TIMEOUT + slack, then the job's
# process group is killed), so this bound only guards the driver itself.
@pytest.mark.timeout(900)
def test_prefetch_keeps_every_invariant_under_random_faults(
    soak_seed: int, soak_workdir: Path
) -> None:
    result = run_soak(SoakConfig(rounds=ROUNDS, seed=soak_seed, workdir=soak_workdir))
    summary = f"seed {result.seed}\n{result.table()}\n" + "\n".join(result.violations[:20])

    assert result.rounds == ROUNDS, summary
    assert result.violations == [], summary
    assert result.hangs == 0, summary
    assert result.corrupt_served == 0, summary
    assert result.lost == 0, summary
    assert result.partial == 0, summary
    assert result.tmp_leaks == 0, summary
    assert result.clean_failures == 0, summary
    assert result.clean_rounds > ROUNDS, summary
    assert result.clean_requests == result.clean_expected, summary
    # The schedule draws every kind (the full disk only where a tmpfs can be mounted).
    expected = set(FAULT_KINDS) - (set() if tmpfs_available() else {"disk_full"})
    assert expected <= set(result.faults), summary
    assert result.tmpfs == tmpfs_available(), summary
    # Faults had teeth: some rounds failed collectively, some ranks were killed.
    assert result.outcomes["failed"] > 0, summary
    assert sum(v for k, v in result.outcomes.items() if k.startswith("killed_")) > 0, summary
