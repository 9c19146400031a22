"""distcache's own gloo group gives each collective the time its call was given.

The gloo group is made within what is left of the meeting's deadline (its timeout bounds
connecting only: a rank that met and went away holds the others no longer than the
timeout), yet a rank that met late leaves later collectives their whole timeout: each
operation carries what is left of its call's timeout where that is longer than
the communicator's, so a call may outlast the group's timeout (one that gives up
sooner leaves its operation queued, for a late rank to complete, as on MPI). A timeout gloo reports itself ("Timed out waiting ...ms") is a
:class:`CollectiveTimeout`, like one the wait reports.

The two ranks of each multi-process test are separate processes on 127.0.0.1 meeting
on a TCPStore this test hosts, each under a hard timeout that kills its process group.
The ranks start their clocks together (a key per rank on the store), so the lateness
below is each rank's, not its interpreter's start-up.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distcache.comm._backend import Budget  # noqa: E402
from distcache.comm._gloo import GlooCommunicator  # noqa: E402
from distcache.errors import CollectiveTimeout  # noqa: E402
from tests.support.helpers import loopback_store, run_group  # noqa: E402
from tests.unit.test_comm_torch_budget import _transport  # noqa: E402

pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parents[2]

#: One rank: ``python -c _RANK SCENARIO RANK PORT [PER_CALL]``. Prints ``RESULT rank op
#: outcome`` per collective (``ok`` or the error's class) and, in ``close``,
#: ``CLOSED seconds``: how long close took after a collective gave up.
_RANK = """
import gc, sys, time
from datetime import timedelta
import torch.distributed as dist
from distcache.comm._gloo import GlooCommunicator
from distcache.errors import DistcacheError

scenario, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
per_call = float(sys.argv[4]) if sys.argv[4:] else None
store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=150))
store.set(f"ready{rank}", "1")
store.wait(["ready0", "ready1"])

def attempt(op, call, expected=None):
    try:
        got = call()
    except DistcacheError as exc:
        print(f"RESULT {rank} {op} {type(exc).__name__}", flush=True)
        return
    print(f"RESULT {rank} {op} {'ok' if got == expected else 'wrong:' + repr(got)}", flush=True)

def comm(timeout, late=0.0):
    if rank == 1:
        time.sleep(late)
    return GlooCommunicator(store, rank, 2, run=(scenario, 0), timeout=timeout)

if scenario == "late":
    # Rank 1 meets 5 s into rank 0's 8 s, then comes to a barrier 4 s after rank 0.
    c = comm(8.0, late=5.0)
    if rank == 1:
        time.sleep(4.0)
    attempt("barrier", c.barrier)
    c.close()
elif scenario == "long":
    # Calls given 8 s on a communicator of 2 s; rank 1 comes to each 4 s late.
    c = comm(2.0)
    for op, call, expected in (
        ("barrier", lambda: c.barrier(timeout=8.0), None),
        ("allgather_object", lambda: c.allgather_object(rank, timeout=8.0), [0, 1]),
        ("broadcast_bytes",
         lambda: c.broadcast_bytes(b"root" if rank == 0 else None, 0, timeout=8.0), b"root"),
    ):
        if rank == 1:
            time.sleep(4.0)
        attempt(op, call, expected)
    c.close()
elif scenario == "absent":
    # Rank 1 meets 1.5 s late, then stays alive but never joins rank 0's call.
    c = comm(3.0, late=1.5)
    if rank == 0:
        attempt("allgather_object", lambda: c.allgather_object(0, timeout=per_call))
        store.set("done", "1")
    else:
        store.wait(["done"])
    c.close()
"""

_RESULT = re.compile(r"RESULT (\d) (\S+) (\S+)")


@pytest.fixture
def store() -> Iterator[Any]:
    """A TCPStore server on loopback for the ranks of one test."""
    with loopback_store() as server:
        yield server


def _ranks(store: Any, scenario: str, *extra: str) -> tuple[str, dict[tuple[int, str], str]]:
    """Run both ranks of ``scenario`` at once, each under a hard timeout; their output,
    and the outcome of each ``(rank, op)``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("DISTCACHE_TIMEOUT", None)
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_group, [sys.executable, "-c", _RANK, scenario, str(rank),
                                        str(store.port), *extra],
                            timeout=120, env=env, cwd=ROOT, merge_stderr=True)
                for rank in (0, 1)]
        done: list[subprocess.CompletedProcess[str]] = [run.result() for run in runs]
    output = "\n".join(f"--- rank {rank} (exit {proc.returncode}):\n{proc.stdout}"
                       for rank, proc in enumerate(done))
    outcomes = {(int(rank), op): outcome
                for proc in done for rank, op, outcome in _RESULT.findall(proc.stdout)}
    return output, outcomes


@pytest.mark.slow
def test_a_rank_that_met_late_leaves_later_collectives_their_whole_timeout(store: Any) -> None:
    # What was left of the meeting's deadline (under 3 s) is not the group's timeout:
    # a barrier that rank 1 reaches 4 s after rank 0 is within the communicator's 8 s.
    output, outcomes = _ranks(store, "late")
    assert outcomes == {(0, "barrier"): "ok", (1, "barrier"): "ok"}, output


@pytest.mark.slow
def test_a_call_may_take_longer_than_the_communicators_timeout_when_given_it(
    store: Any,
) -> None:
    # Each kind of operation (all-reduce, all-gather, broadcast) carries its call's 8 s
    # past the group's 2 s.
    output, outcomes = _ranks(store, "long")
    ops = ("barrier", "allgather_object", "broadcast_bytes")
    assert outcomes == {(rank, op): "ok" for rank in (0, 1) for op in ops}, output


@pytest.mark.slow
@pytest.mark.parametrize("per_call", [None, 5.0], ids=["default", "longer-than-default"])
def test_a_peer_that_never_comes_is_a_collective_timeout(
    store: Any, per_call: float | None
) -> None:
    output, outcomes = _ranks(store, "absent", *([] if per_call is None else [str(per_call)]))
    assert outcomes == {(0, "allgather_object"): "CollectiveTimeout"}, output


# -- in this process ----------------------------------------------------------------------


def _recording(monkeypatch: pytest.MonkeyPatch, cls: type, fail: bool) -> list[timedelta]:
    made: list[timedelta] = []
    real = cls._make_group

    def recording(torch: Any, dist: Any, store: Any, rank: int, size: int,
                  timeout: timedelta) -> Any:
        made.append(timeout)
        if fail:
            raise RuntimeError("not made here")
        return real(torch, dist, store, rank, size, timeout)

    monkeypatch.setattr(cls, "_make_group", staticmethod(recording))
    return made


def test_the_gloo_group_is_made_within_what_the_deadline_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each collective sets its own timeout on gloo: the group's bounds connecting only,
    # so a rank that met and then went away does not cost the others another timeout.
    import torch.distributed as dist

    made = _recording(monkeypatch, GlooCommunicator, fail=False)
    comm = GlooCommunicator(dist.HashStore(), 0, 1, run=("solo", 0),
                            until=time.monotonic() + 5.0, timeout=30.0)
    try:
        assert comm.allgather_object("x") == ["x"]
    finally:
        comm.close()
    assert len(made) == 1 and timedelta(0) < made[0] <= timedelta(seconds=5), made


def test_an_nccl_group_keeps_the_communicators_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # NCCL's watchdog keeps the group's timeout for its life.
    import torch.distributed as dist

    from distcache.comm._gloo import NcclCommunicator
    from distcache.errors import CommError

    made = _recording(monkeypatch, NcclCommunicator, fail=True)
    with pytest.raises(CommError, match="not made here"):
        NcclCommunicator(dist.HashStore(), 0, 1, run=("solo", 0),
                         until=time.monotonic() + 5.0, timeout=30.0)
    assert made == [timedelta(seconds=30)]


def test_no_time_left_to_make_the_group_is_a_collective_timeout() -> None:
    import torch.distributed as dist

    with pytest.raises(CollectiveTimeout, match="no time left"):
        GlooCommunicator(dist.HashStore(), 0, 1, run=("solo", 0),
                         until=time.monotonic() - 1.0, timeout=30.0)


class _FailedWork:
    """A started collective whose wait fails with ``text``, as torch's does."""

    def __init__(self, text: str) -> None:
        self.text = text

    def wait(self, timeout: timedelta) -> bool:
        raise RuntimeError(self.text)


@pytest.mark.parametrize("text", [
    "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1481ms "
    "for recv operation to complete",
    "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 2483ms "
    "for send operation to complete",
])
def test_gloos_own_timed_out_is_a_collective_timeout(text: str) -> None:
    comm = _transport()
    with pytest.raises(CollectiveTimeout) as caught:
        comm._run("allgather_object", Budget(5.0, time.monotonic() + 5.0),
                  lambda: _FailedWork(text))
    assert caught.value.op == "allgather_object"
    assert isinstance(caught.value.__cause__, RuntimeError)
