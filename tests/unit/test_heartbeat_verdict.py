"""Which failure every rank reports when one rank's work stalls: the stall, not the
timeout it caused on a peer; a real failure on a peer still wins over the stall."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from distcache.collective._heartbeat import Failure, heartbeats, primary
from distcache.comm import ThreadGroup
from tests.support.helpers import on_threads

TIMEOUT = 2.0


class Agreed(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure[4])
        self.failure = failure


def _raise_first(failures: Iterable[Failure | None]) -> None:
    found = [f for f in failures if f is not None]
    if found:
        raise Agreed(primary(found))


def _stalled(rank: int, idle: float, _detail: Any, host: str) -> Failure:
    return ("move", None, rank, host,
            f"CollectiveTimeout: the move made no progress for {idle:.0f} s on rank {rank}")


def _beat(peer_failure: Failure) -> list[Any]:
    """Two ranks beat the heart: rank 0's work is over with ``peer_failure``, rank 1's
    never ends and has been idle past the timeout. What each rank raised."""
    group = ThreadGroup(2, timeout=TIMEOUT)

    def rank(r: int) -> None:
        def step(beat: float) -> tuple[bool, float, Any, Failure | None]:
            if r == 0:
                return True, 0.0, None, peer_failure
            return False, TIMEOUT + 1.0, None, None

        heartbeats(group.comm(r), TIMEOUT, step, _raise_first, _stalled)

    return on_threads(2, rank, join=30)


def test_a_stall_is_reported_over_the_timeout_it_caused_on_a_lower_rank() -> None:
    # Rank 0 (a source) timed out waiting for rank 1 (a receiver stuck on its disk):
    # by rank alone the timeout would win; the stall names where the job is stuck.
    timeout = ("move", None, 0, "node0",
               "CollectiveTimeout: broadcast_bytes did not complete within 2 s")
    raised = _beat(timeout)
    for exc in raised:
        assert isinstance(exc, Agreed)
        assert exc.failure[2] == 1 and "made no progress" in exc.failure[4]


@pytest.mark.parametrize("cause", ["IntegrityError: bucket 3 is malformed",
                                   "PoolError: cannot publish: No space left on device"])
def test_a_real_failure_on_a_peer_is_still_reported_over_a_stall(cause: str) -> None:
    failure = ("move", None, 0, "node0", cause)
    raised = _beat(failure)
    for exc in raised:
        assert isinstance(exc, Agreed) and exc.failure == failure
