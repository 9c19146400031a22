"""The run scope: what every rank agrees on once, when distcache adopts its communicator.

A :class:`RunScope` is the launcher's job id, the restart attempt, a nonce chosen for
this adoption and a secret of this run. Every store key and group name distcache makes
derives from :attr:`RunScope.prefix`, so two adoptions never meet each other's keys:
the ``python -m launch`` wrapper and the program it starts, two ``init``/``close``
cycles in one process, a torchrun restart, two jobs sharing one agent store.

Agreeing on a store that outlives processes (torchrun's agent store lives as long as
the agent, across worker restarts; torch's workers are plain clients of it, and only
the agents' own keys carry a ``torch.rendezvous.<run id>.<round>`` prefix):

1. each rank counts its adoptions in this ``(job, attempt)`` on the store itself
   (``store.add``, atomic). Ranks adopt in the same order (adopting is collective), so
   the n-th adoption of every rank is the same meeting, whichever process makes it and
   however late a rank comes; a count kept in a process (the wrapper's, then its
   program's) would start at 0 again;
2. rank 0 claims meeting n with a fresh nonce (``compare_set`` on an absent key: an
   existing one means another process claimed it, refused); the others wait for it, up
   to the deadline. A meeting's key is written once, so no rank can read a nonce of an
   earlier meeting, wrapper or attempt;
3. every rank counts itself in; the last one marks the meeting complete, a rank whose
   deadline passes first marks it abandoned (one ``compare_set``, so all read the same
   outcome): gloo is only dialled once every rank is known to be there;
4. the group meets under ``<job>/<attempt>/<n>/<nonce>``; rank 0's secret travels over
   the group once it is made, never through the store (whoever can read the store need
   not learn it).

A rank that comes to meeting n after its peer gave up on it raises at once. A rank that
gave up on meeting n and adopts again is one meeting ahead of a peer that comes late
to n: both raise within their timeouts, and a restart (a new attempt) starts the
counts again.

Values read from the store are parsed strictly (a nonce is 32 hex digits), never
unpickled. The secret is never logged: it is left out of ``repr``.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Any, NamedTuple

from distcache.comm._base import Communicator
from distcache.errors import CollectiveTimeout, CommError, DistcacheError

#: Every key distcache writes to a store it shares starts with this.
ROOT = "distcache"
NONCE_BYTES = 16
SECRET_BYTES = 32
_NONCE = re.compile(rb"[0-9a-f]{%d}" % (2 * NONCE_BYTES))


class RunScope(NamedTuple):
    """One adoption's identity, the same on every rank of it."""

    job: str
    """The launcher's name for the run (:func:`launch.run_id`); ``""`` when none."""
    attempt: int
    """The restart attempt (:func:`launch.run_id`)."""
    nonce: str
    """32 hex digits rank 0 chose for this adoption."""
    secret: bytes
    """32 random bytes from rank 0, for authenticating peers; never logged."""

    def __repr__(self) -> str:
        return f"RunScope(job={self.job!r}, attempt={self.attempt}, nonce={self.nonce!r})"

    @property
    def prefix(self) -> str:
        """The store prefix every key and group name of this adoption starts with."""
        return f"{job_root(self.job, self.attempt)}/{self.nonce}"

    def key(self, *parts: str) -> str:
        """A store key (or group name) of this adoption: ``prefix/part/...``."""
        return "/".join((self.prefix, *parts))


def job_root(job: str, attempt: int) -> str:
    """The store prefix of one job's attempt; the job id is hashed, so that whatever
    characters a launcher puts in it, keys stay short and unambiguous."""
    digest = hashlib.sha256(job.encode()).hexdigest()[:16]
    return f"{ROOT}/{digest}/{attempt}"


def fresh(job: str, attempt: int) -> RunScope:
    """A scope of this process alone (a world of one)."""
    return RunScope(job, attempt, os.urandom(NONCE_BYTES).hex(),
                    os.urandom(SECRET_BYTES))


def _left(until: float) -> float:
    return max(until - time.monotonic(), 0.001)


class StoreLost(CommError):
    """The store's server closed this rank's connection in the middle of a meeting: the
    store an earlier adoption's rank 0 hosted (a finished ``init``, the launch
    wrapper's) went away while this rank, already on to the next adoption, was still
    connected to it. Attributes: those of :class:`CommError`."""


#: What torch's store client says when its server went away (``DistNetworkError``).
_LOST = ("connection was likely closed", "connection reset", "broken pipe",
         "connection refused")


def _lost(exc: BaseException) -> bool:
    text = str(exc).lower()
    if "socket timeout" in text:  # a server that does not answer: a timeout, not a loss
        return False
    return type(exc).__name__ == "DistNetworkError" or any(t in text for t in _LOST)


def _wait_for(until: float) -> Any:
    """What a store's ``wait`` takes for the seconds left until ``until``."""
    from datetime import timedelta  # for the gloo rendezvous only

    return timedelta(seconds=_left(until))


def _timed_out(exc: BaseException) -> bool:
    # torch names its receive "recvValueWithTimeout" in a lost connection's message.
    return not _lost(exc) and (isinstance(exc, TimeoutError)
                               or "timeout" in str(exc).lower())


def parse_nonce(raw: bytes, where: str) -> str:
    """A nonce read from a store, checked to be exactly what :func:`meet` writes.

    Raises:
        CommError: anything else is in the key.
    """
    if not _NONCE.fullmatch(raw):
        raise CommError(
            f"the store key {where!r} holds {raw[:80]!r}, not a nonce of "
            f"{2 * NONCE_BYTES} hex digits; something other than distcache wrote it",
            op="rendezvous", backend="gloo",
        )
    return raw.decode()


def meet(store: Any, rank: int, size: int, job: str, attempt: int, until: float) -> str:
    """Agree with every rank on this adoption's nonce over ``store`` (see the module
    docstring) and wait until every rank has come to it; returns the nonce. Collective
    over the ``size`` ranks; waits no later than ``until`` (a ``time.monotonic()``
    value).

    Raises:
        CollectiveTimeout: not every rank came by ``until``, or a rank gave up on this
            adoption before every rank came.
        CommError: the store failed, or holds something other than distcache's values.
    """
    root = job_root(job, attempt)
    where = "(counting)"
    try:
        count = int(store.add(f"{root}/adoptions/rank{rank}", 1))
        where = f"{root}/{count}/nonce"
        if rank == 0:
            nonce = os.urandom(NONCE_BYTES).hex()
            found = store.compare_set(where, "", nonce)
            if parse_nonce(bytes(found), where) != nonce:
                raise CommError(
                    f"rank 0/{size}: adoption {count} of job {job!r} attempt {attempt} was "
                    f"already claimed under {where!r}: two processes run as rank 0 of one "
                    "job on one store; give each run its own id (torchrun --rdzv-id)",
                    op="rendezvous", rank=rank, backend="gloo",
                )
        else:
            store.wait([where], _wait_for(until))
            nonce = parse_nonce(bytes(store.get(where)), where)
        where = f"{root}/{count}/state"
        _all_came(store, f"{root}/{count}", rank, size, until)
        return nonce
    except DistcacheError:
        raise  # already ours (a CollectiveTimeout is an OSError too)
    except (RuntimeError, OSError) as exc:
        if _lost(exc):
            raise StoreLost(
                f"rank {rank}/{size}: the rendezvous store closed the connection at "
                f"{where!r} ({exc})", op="rendezvous", rank=rank, backend="gloo",
            ) from exc
        if _timed_out(exc):
            raise CollectiveTimeout(
                f"rank {rank}/{size}: rank 0 did not open distcache's adoption under "
                f"{where!r} in time ({exc}); every rank must call distcache.init (or "
                "the same collective) within the timeout",
                op="rendezvous", rank=rank,
            ) from exc
        raise CommError(f"rank {rank}/{size}: the rendezvous store failed at {where!r}: "
                        f"{exc}", op="rendezvous", rank=rank, backend="gloo") from exc


def _all_came(store: Any, meeting: str, rank: int, size: int, until: float) -> None:
    """Return once every rank has come to ``meeting``; one outcome for all of them.

    The last rank to come marks the meeting complete; a rank whose deadline passes first
    marks it abandoned. Both use ``compare_set`` on one key, so exactly one wins and
    every rank reads the same outcome: a rank that comes after its peer gave up (and
    left, or is exiting) learns so at once, instead of dialling that peer's gloo address
    and waiting on gloo's own connect timeout (10 s, whatever the group's timeout).

    Raises:
        CollectiveTimeout: the meeting was abandoned, by this rank or another.
        CommError: the state key holds something else.
    """
    state = f"{meeting}/state"
    mine = ""
    if int(store.add(f"{meeting}/arrived", 1)) == size:
        outcome = bytes(store.compare_set(state, "", "complete"))
    else:
        try:
            store.wait([state], _wait_for(until))
            outcome = bytes(store.get(state))
        except RuntimeError as exc:
            if not _timed_out(exc):
                raise
            mine = "abandoned"
            outcome = bytes(store.compare_set(state, "", mine))
    if outcome == b"complete":
        return
    if outcome != b"abandoned":
        raise CommError(f"the store key {state!r} holds {outcome[:80]!r}, not distcache's "
                        "meeting state; something other than distcache wrote it",
                        op="rendezvous", rank=rank, backend="gloo")
    came = int(store.add(f"{meeting}/arrived", 0))
    who = "this rank" if mine else "another rank"
    raise CollectiveTimeout(
        f"rank {rank}/{size}: {who} gave up on distcache's adoption under {meeting!r} "
        f"with {came} of {size} ranks come; every rank must call distcache.init (or the "
        "same collective) within the timeout",
        op="rendezvous", rank=rank,
    )


def share_secret(comm: Communicator, until: float) -> bytes:
    """Rank 0's fresh secret, on every rank of ``comm``. Collective.

    Raises:
        CollectiveTimeout: not every rank came by ``until``.
        CommError: rank 0's message is not a secret.
    """
    mine = os.urandom(SECRET_BYTES) if comm.rank == 0 else None
    got = comm.broadcast_bytes(mine, 0, timeout=_left(until))
    if len(got) != SECRET_BYTES:
        raise CommError(f"rank {comm.rank}: rank 0 sent a secret of {len(got)} bytes, "
                        f"expected {SECRET_BYTES}", op="init", rank=comm.rank)
    return bytes(got)


#: The length of :func:`drawn`.
DRAWN_BYTES = 2 * NONCE_BYTES + SECRET_BYTES


def drawn() -> bytes:
    """A fresh scope's nonce (hex) and secret, as rank 0 sends them."""
    return os.urandom(NONCE_BYTES).hex().encode() + os.urandom(SECRET_BYTES)


def scope_of(got: bytes, job: str, attempt: int, rank: int) -> RunScope:
    """The scope of rank 0's :func:`drawn` bytes.

    Raises:
        CommError: ``got`` is not a nonce and a secret.
    """
    if len(got) != DRAWN_BYTES:
        raise CommError(f"rank {rank}: rank 0 sent a scope of {len(got)} bytes, "
                        f"expected {DRAWN_BYTES}", op="init", rank=rank)
    nonce = parse_nonce(got[: 2 * NONCE_BYTES], "rank 0's scope")
    return RunScope(job, attempt, nonce, got[2 * NONCE_BYTES:])
