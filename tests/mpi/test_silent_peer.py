"""A peer that goes silent in the middle of a prefetch's fetch, over real processes
(MPI or torch gloo, per ``DISTCACHE_TEST_COMM``): the ranks that wait for it fail with
the same typed error within the timeout, although the origin keeps delivering.

The other side of the rule, a slow steady origin that finishes past the timeout, is
``test_prefetch.py::test_a_slow_steady_origin_finishes_on_every_rank_past_the_timeout``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import parse_checksums
from distcache.collective import prefetch
from distcache.comm._base import Communicator
from distcache.comm._codec import encode
from distcache.comm._inline import head, inline_width
from distcache.errors import CollectiveTimeout, CommError, PrefetchError
from distcache.origins import HttpOrigin
from distcache.store._pool import ArtifactPool
from tests.support.helpers import serve_slowly

STEADY = 40  # artifacts, one download at a time: about 10 s of steady progress
SLOW = 0.25  # seconds the origin takes for each
SHORT = 2.0  # DISTCACHE_TIMEOUT
#: How long the silent rank stays silent: well past the timeout.
SILENCE = SHORT + 5.0
#: Heartbeats come every min(1 s, timeout / 4); the rest is a loaded machine's slack.
SLACK = 4.0


def _requests(url: str) -> int:
    with urllib.request.urlopen(f"{url}/_stats", timeout=10) as answer:
        return int(json.load(answer)["total_requests"])


class _Silent:
    """The last rank's communicator: once the origin has served a request (the fetch is
    under way) its next all-gather does not arrive for ``SILENCE`` seconds, as a process
    stopped or stuck mid-collective. Then it completes the part of the collective its
    peers abandoned (an all-gather of heads, each a payload's length and first bytes,
    comes first), so nothing is left
    pending in the backend, and gives up itself."""

    def __init__(self, inner: Communicator, url: str) -> None:
        self.inner, self.url = inner, url
        self.silent_since: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> Any:
        if self.silent_since is None and _requests(self.url) > 0:
            self.silent_since = time.time()
            time.sleep(SILENCE)
            inner: Any = self.inner  # a BackendCommunicator: MPI or gloo
            inner._allgather_blocks(head(encode(obj), inline_width(inner.size)),
                                    inner._budget(60))
            raise CommError("this rank went silent on purpose", op="allgather",
                            rank=self.inner.rank)
        return self.inner.allgather_object(obj, timeout=timeout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_a_peer_silent_in_the_fetch_fails_every_other_rank_within_the_timeout(
    comm: Communicator, comm_factory: Callable[..., Communicator], shared_tmp: Path
) -> None:
    mirror = shared_tmp / "slow"
    server, url = serve_slowly(comm, mirror, STEADY, SLOW, seed=13)
    artifacts = parse_checksums((mirror / "checksums.txt").read_text())
    # A timed-out collective retires its communicator: a fresh one takes the damage.
    doomed = comm_factory()
    late = comm.size - 1
    silent = _Silent(doomed, url) if comm.rank == late else None
    pool = ArtifactPool(shared_tmp / "pools" / f"rank{comm.rank}")
    try:
        with pytest.raises(PrefetchError) as caught:
            prefetch(artifacts, comm=silent if silent is not None else doomed, pool=pool,
                     origin=HttpOrigin(url, retries=0), timeout=SHORT,
                     downloads_per_rank=1, downloads_per_job=1)
        failed_at = time.time()
        served = _requests(url) if comm.rank == 0 else None
        cause = type(caught.value.__cause__).__name__
        seen = comm.allgather_object(
            (cause, failed_at, silent.silent_since if silent is not None else None, served))
    finally:
        comm.barrier()
        if server is not None:
            server.stop()
    since = seen[late][2]
    assert since is not None, seen
    for rank, (cause, at, _, _) in enumerate(seen[:late]):
        # A typed error, caused by the peer that did not arrive, within the timeout.
        assert cause == CollectiveTimeout.__name__, (rank, seen)
        assert at - since < SHORT + SLACK, (rank, at - since, seen)
    # It failed while the origin was still delivering: progress did not hide the silence.
    assert seen[0][3] is not None and seen[0][3] < STEADY, seen
