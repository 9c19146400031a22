"""The torch transport takes one call's timeout once, however many chunks or rounds
the call has: each wait is for what is left of it."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distcache.comm._backend import Budget  # noqa: E402
from distcache.comm._torch import TorchCommunicator  # noqa: E402
from distcache.errors import CollectiveTimeout  # noqa: E402


class PacedWork:
    """A started collective that completes after ``pace`` seconds, unless the wait it
    is given is shorter (then it times out, as torch's does)."""

    def __init__(self, pace: float, waits: list[float]) -> None:
        self.pace, self.waits = pace, waits

    def wait(self, timeout: timedelta) -> bool:
        self.waits.append(timeout.total_seconds())
        if timeout.total_seconds() < self.pace:
            time.sleep(timeout.total_seconds())
            raise RuntimeError("wait timed out")
        time.sleep(self.pace)
        return True


def _transport() -> Any:
    comm = TorchCommunicator.__new__(TorchCommunicator)
    comm._device = torch.device("cpu")
    comm._rank, comm._size, comm._node_id, comm._kind = 1, 2, "node0", "torch"
    comm._broken, comm._timeout = None, 600.0
    return comm


def test_chunks_answered_just_in_time_do_not_stretch_a_call_past_its_timeout() -> None:
    comm, waits = _transport(), []
    began = time.monotonic()
    budget = Budget(0.5, began + 0.5)
    # A peer answering each of six chunks after 0.15 s: each chunk alone is within
    # 0.5 s, the call as a whole is not.
    with pytest.raises(CollectiveTimeout):
        for _ in range(6):
            comm._run("broadcast_bytes", budget, lambda: PacedWork(0.15, waits))
    assert time.monotonic() - began < 0.8
    assert all(w <= 0.5 for w in waits) and waits[-1] < 0.15, waits
    assert comm._broken is not None  # a call that gave up leaves the transport retired


def test_a_call_whose_time_is_spent_starts_no_further_chunk() -> None:
    comm, started = _transport(), []
    budget = Budget(0.2, time.monotonic() - 0.01)
    with pytest.raises(CollectiveTimeout, match=r"0\.2 s"):
        comm._run("barrier", budget, lambda: started.append(1))
    assert started == []
