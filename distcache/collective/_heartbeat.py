"""Heartbeats: how a phase whose work runs on threads tells absence from slowness.

While a phase's work runs (downloads in the fetch phase, the writers' move of buckets
in the move phase), every rank of the collective enters a small all-gather at least
every ``min(HEARTBEAT, timeout / 4)`` seconds; a rank whose work is over enters at
once. Each carries whether the rank's work is over, how long ago it last made
progress (a byte, a bucket, an artifact published), a detail for messages, and, once
over, the rank's failure. The phase ends when every rank's work is over; a phase
that may halt (the fetch) stops every rank's work at the beat that carries a failure
halting it (an origin or a pool that failed, not one artifact). It fails on
every rank alike when a rank made no progress for ``timeout`` seconds, or when a rank
misses a heartbeat by ``timeout`` (the all-gather raises
:class:`~distcache.errors.CollectiveTimeout`). A rank that takes no part in the work
waits as long as the others make progress, and no longer. The beats of a move also
tell each writer when its next audience's members are all there
(:class:`~distcache.collective._audience.Turns`): a writer waiting for its turn
waits as long as the others make progress, too.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from distcache._log import get_logger
from distcache.collective._audience import Turns
from distcache.comm import Communicator, reduce_object
from distcache.errors import WireError

log = get_logger(__name__)

#: Longest interval between two heartbeats (see the module docstring).
HEARTBEAT = 1.0

#: (phase, artifact name or None, rank, host, "Type: message")
Failure = tuple[str, str | None, int, str, str]

#: How a failure that is a collective's timeout begins ("Type: message").
TIMED_OUT = "CollectiveTimeout:"

_FAILURE_TYPES: tuple[type | tuple[type, ...], ...] = (str, (str, type(None)), int, str, str)


def sent_failures(failures: Iterable[Failure | None], operation: str) -> list[Failure]:
    """The failures of ``failures`` (one per rank, in rank order, ``None`` where a rank
    did not fail), each checked to be a :data:`Failure` as another rank sent it.

    Raises:
        WireError: a rank sent something else (naming it): every rank received the
            same, so every rank raises it alike.
    """
    found: list[Failure] = []
    for rank, failure in enumerate(failures):
        if failure is None:
            continue
        if not _is_failure(failure):
            raise WireError(f"{operation}: rank {rank} sent a malformed failure record "
                            f"{failure!r:.120}", op="decode", peer=rank, agreed=True)
        found.append(failure)
    return found


def _is_failure(value: Any) -> bool:
    return type(value) is tuple and len(value) == len(_FAILURE_TYPES) and all(
        isinstance(v, t) and type(v) is not bool
        for v, t in zip(value, _FAILURE_TYPES, strict=True))


def _checked_state(state: Any) -> dict[str, Any]:
    """One rank's heartbeat state (or a partial combination of them), checked for
    its shape: every rank combines the same states, so a malformed one is a
    WireError alike on every rank, not a raw error on some."""
    late = state.get("late") if type(state) is dict else None
    if not (type(state) is dict and set(state) == {"over", "late", "failure", "ready", "halt"}
            and type(state["over"]) is bool and type(state["ready"]) is int
            and type(state["halt"]) is bool
            and (late is None or (type(late) is tuple and len(late) == 4
                                  and type(late[0]) is int and type(late[1]) in (int, float)
                                  and type(late[3]) is str))
            and (state["failure"] is None or _is_failure(state["failure"]))):
        raise WireError(f"a rank sent a malformed heartbeat {state!r:.120}", op="heartbeat",
                        agreed=True)
    return state


def primary(failures: Iterable[Failure]) -> Failure:
    """The failure every rank reports: the lowest rank that failed other than by a
    timeout, if any did (a timeout is often what another rank's failure did to its
    peers: a receiver that stopped taking buckets leaves its source waiting), else the
    lowest rank. ``failures`` must not be empty."""
    return min(failures, key=lambda f: (f[4].startswith(TIMED_OUT), f[2]))


#: One rank's step: wait at most the given seconds, then say (over, seconds idle,
#: detail, failure once over).
Step = Callable[[float], tuple[bool, float, Any, Failure | None]]
#: (whether this rank's failure halts every rank's work, stop this rank's work).
Halt = tuple[Callable[[], bool], Callable[[], object]]


def heartbeats(
    comm: Communicator,
    timeout: float,
    step: Step,
    raise_first: Callable[[Iterable[Failure | None]], None],
    stalled: Callable[[int, float, Any, str], Failure],
    turns: Turns | None = None,
    *,
    halt: Halt | None = None,
) -> None:
    """Collective: beat until every rank's work is over (the rule: the module docstring).

    ``raise_first`` raises the agreed error from every rank's failures; ``stalled``
    builds the failure of rank ``r`` idle for ``s`` seconds, from its detail and host.
    Each beat is one reduction (:func:`~distcache.comm.reduce_object`): whether all
    are over, the lowest stalled rank and the primary failure, so what a rank receives
    does not grow with the job. ``turns``: the move's, told each beat's combined
    readiness, and abandoned when the beats fail. ``halt``: whether this rank's work,
    once over, failed so as to halt every rank's, and how to stop this rank's work
    when another rank's does (its next step is then over).
    """
    try:
        _beat(comm, timeout, step, raise_first, stalled, turns, halt)
    except BaseException:
        if turns is not None:
            turns.abandon()
        raise


def _beat(comm: Communicator, timeout: float, step: Step,
          raise_first: Callable[[Iterable[Failure | None]], None],
          stalled: Callable[[int, float, Any, str], Failure], turns: Turns | None,
          halt: Halt | None) -> None:
    beat = min(HEARTBEAT, timeout / 4)
    while True:
        done, idle, detail, failure = step(beat)
        late = None if done or idle < timeout else (comm.rank, idle, detail, comm.node_id)
        state = reduce_object(comm, {"over": done, "late": late,
                                     "failure": failure if done else None,
                                     "ready": -1 if turns is None else turns.ready(),
                                     "halt": halt is not None and done and halt[0]()},
                              _combine, timeout=timeout)
        if turns is not None:
            turns.heard(state["ready"])
        if state["over"]:
            raise_first([state["failure"]])
            return
        if state["halt"] and halt is not None and not done:
            halt[1]()  # another rank's work failed so: this rank's ends, and says so
        if state["late"] is not None:
            # A rank whose work already failed is a candidate beside the stalled one,
            # chosen by primary(): before a move's stall (a receiver that met a
            # malformed bucket leaves its source waiting), by rank against a fetch's.
            # A timeout is not: it is what the stall did to a peer (a source waiting
            # for a receiver stuck on its disk), and the stall names where it is.
            rank, idle, detail, host = state["late"]
            failure = state["failure"]
            if failure is not None and failure[4].startswith(TIMED_OUT):
                failure = None
            raise_first([failure, stalled(rank, idle, detail, host)])


def _combine(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One beat's states combined (partial combinations give the same result)."""
    states = [_checked_state(s) for s in states]
    late = [s["late"] for s in states if s["late"] is not None]
    failures = [s["failure"] for s in states if s["failure"] is not None]
    ready = -1
    for s in states:
        ready &= s.get("ready", -1)
    return {"over": all(s["over"] for s in states),
            "late": min(late, key=lambda entry: entry[0]) if late else None,
            "failure": primary(failures) if failures else None,
            "ready": ready, "halt": any(s["halt"] for s in states)}


class Activity:
    """When work last moved forward (monotonic seconds)."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def touch(self, *_: object) -> None:
        self._last = time.monotonic()

    def idle(self) -> float:
        return time.monotonic() - self._last


class Worker:
    """``work`` on a daemon thread (``None``: nothing to do, over at once); its result
    or what it raised is kept for the caller."""

    def __init__(self, name: str, work: Callable[[], Any] | None) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        if work is None:
            self._done.set()
            return

        def run() -> None:
            try:
                self.result = work()
            except BaseException as exc:  # the caller turns it into this rank's failure
                self.error = exc
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=f"distcache-{name}", daemon=True)
        self._thread.start()

    def wait(self, seconds: float) -> bool:
        return self._done.wait(seconds)

    def join(self, seconds: float) -> None:
        """Wait for the thread at most ``seconds`` (its own waits are bounded by the
        timeout too); one still running is logged and left, a daemon."""
        if self._thread is None:
            return
        self._thread.join(seconds)
        if self._thread.is_alive():
            log.warning("%s is still running after the collective gave up; left to end "
                        "on its own (its waits are bounded by the timeout)", self._thread.name)


def concurrent(comm: Communicator) -> bool:
    """Whether two threads may each use one of ``comm``'s communicators at once: always
    on gloo and the in-process ones; on MPI only at ``MPI_THREAD_MULTIPLE`` (mpi4py asks
    for it; an engine that initialised MPI itself may have asked for less)."""
    if "mpi" not in comm.backend.split("+"):  # e.g. "mpi+torch": MPI carries control
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Query_thread() >= mpi.THREAD_MULTIPLE)
