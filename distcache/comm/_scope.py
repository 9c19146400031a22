"""The run scope: what every rank agrees on once, when distcache adopts its communicator.

A :class:`RunScope` is the launcher's job id, the restart attempt, a nonce chosen for
this adoption and a secret of this run. Every store key and group name distcache makes
derives from :attr:`RunScope.prefix` (the job and the nonce), so two adoptions never
meet each other's keys: the ``python -m launch`` wrapper and the program it starts, two
``init``/``close`` cycles in one process, a torchrun restart, two jobs sharing one
agent store.

Agreeing on a store that outlives processes (torchrun's agent store lives as long as
the agent, across worker restarts; torch's workers are plain clients of it, and only
the agents' own keys carry a ``torch.rendezvous.<run id>.<round>`` prefix) cannot rest
on anything the ranks count or read from their environment: torch raises
``TORCHELASTIC_RESTART_COUNT`` only on the node whose workers failed (a restart for a
membership change does not count), so the nodes of one round may hold different
counts, and a rank's earlier adoptions may have ended anywhere. Each adoption is a
handshake between processes instead, under ``distcache/<hash of the job id>/``:

1. every rank but 0 draws a token of its own and writes it as its hello
   (``hello/<rank>``, overwriting any earlier process's), then waits for rank 0's
   answer under ``ack/<rank>/<token>``, a key only this process can have asked for;
2. rank 0 draws the adoption's nonce, and for each rank answers the token its hello
   holds with the nonce, rank 0's attempt (which every rank then reports) and its world
   size (a rank holding another fails the meeting for all), then waits for that rank
   to count itself in under ``<nonce>/in/<rank>`` with that token. Rank 0 reads every
   hello again on each pass: a hello an earlier process left is answered and never
   counted in, and a rank whose process died and was started again is answered anew
   and counted once, by the live process's token;
3. once every rank is in, rank 0 marks the meeting complete; a rank whose deadline
   passes first marks it abandoned (one ``compare_set``, so all read the same outcome):
   gloo is only dialled once every rank is known to be there;
4. the group meets under ``<job>/<nonce>``; rank 0's secret travels over the group once
   it is made, never through the store (whoever can read the store need not learn it).

A rank that comes after rank 0 gave up (or completed) waits for an answer until its
own deadline and raises :class:`~distcache.errors.CollectiveTimeout`; it never dials
an address an earlier process left.

Values read from the store are parsed strictly (a nonce or token is 32 hex digits),
never unpickled. The secret is never logged: it is left out of ``repr``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from typing import Any, NamedTuple

from distcache.comm._base import Communicator
from distcache.errors import CollectiveTimeout, CommError, DistcacheError, LaunchError

#: Every key distcache writes to a store it shares starts with this.
ROOT = "distcache"
NONCE_BYTES = 16
SECRET_BYTES = 32
_NONCE = re.compile(rb"[0-9a-f]{%d}" % (2 * NONCE_BYTES))
_ANSWER = re.compile(rb"([0-9a-f]{%d}):([0-9]{1,9}):([0-9]{1,9})" % (2 * NONCE_BYTES))
_ABANDONED = re.compile(rb"abandoned:([0-9]{1,9})")
_SIZES = re.compile(rb"sizes:([0-9]{1,9}):([0-9]{1,9}):([0-9]{1,9})")
#: The longest pause of rank 0 between two looks at the ranks' keys.
_STEP_MAX_S = 0.5


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
        return f"{job_root(self.job)}/{self.nonce}"

    def key(self, *parts: str) -> str:
        """A store key (or group name) of this adoption: ``prefix/part/...``."""
        return "/".join((self.prefix, *parts))


def job_root(job: str) -> str:
    """The store prefix of one job; the job id is hashed, so that whatever characters
    a launcher puts in it, keys stay short and unambiguous."""
    digest = hashlib.sha256(job.encode()).hexdigest()[:16]
    return f"{ROOT}/{digest}"


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


def _wait_for(until: float, most: float | None = None) -> Any:
    """What a store's ``wait`` takes for the seconds left until ``until`` (at most
    ``most``)."""
    from datetime import timedelta  # for the gloo rendezvous only

    left = _left(until)
    return timedelta(seconds=left if most is None else min(left, most))


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


def meet(store: Any, rank: int, size: int, job: str, attempt: int,
         until: float) -> tuple[str, int]:
    """Agree with every rank on this adoption's nonce over ``store`` (see the module
    docstring) and wait until every rank has come to it; returns the nonce and rank
    0's ``attempt``. Collective over the ``size`` ranks; waits no later than ``until``
    (a ``time.monotonic()`` value).

    Raises:
        CollectiveTimeout: not every rank came by ``until``, or a rank gave up on this
            adoption before every rank came.
        LaunchError: a rank holds another world size than rank 0.
        CommError: the store failed, or holds something other than distcache's values.
    """
    root = job_root(job)
    where = f"{root}/hello/{rank}"
    try:
        if rank == 0:
            nonce = os.urandom(NONCE_BYTES).hex()
            where = f"{root}/hello"
            missing = _answer_all(store, root, size, nonce, attempt, until)
            where = f"{root}/{nonce}/state"
            if missing is not None:
                _decided(store, f"{root}/{nonce}", rank, size, bytes(store.compare_set(
                    where, "", f"abandoned:{rank}")), missing=missing)
            _decided(store, f"{root}/{nonce}", rank, size, bytes(
                store.compare_set(where, "", "complete")))
            return nonce, attempt
        token = os.urandom(NONCE_BYTES).hex()
        store.set(where, token)
        where = f"{root}/ack/{rank}/{token}"
        store.wait([where], _wait_for(until))
        answer = _ANSWER.fullmatch(bytes(store.get(where)))
        if answer is None:
            raise CommError(f"the store key {where!r} holds something other than rank 0's "
                            "answer; something other than distcache wrote it",
                            op="rendezvous", rank=rank, backend="gloo")
        nonce, agreed, theirs = (answer.group(1).decode(), int(answer.group(2)),
                                 int(answer.group(3)))
        _forget(store, where)
        meeting = f"{root}/{nonce}"
        where = f"{meeting}/state"
        if theirs != size:  # fail the meeting for every rank that waits on it
            outcome = f"sizes:{rank}:{size}:{theirs}"
            _decided(store, meeting, rank, size, bytes(store.compare_set(where, "", outcome)))
            _decided(store, meeting, rank, size, outcome.encode())
        where = f"{meeting}/in/{rank}"
        store.set(where, token)
        store.add(f"{meeting}/arrived", 1)
        where = f"{meeting}/state"
        try:
            _all_came(store, meeting, rank, size, until)
        finally:
            _forget(store, f"{meeting}/in/{rank}")
        return nonce, agreed
    except DistcacheError:
        raise  # already ours (a CollectiveTimeout is an OSError too)
    except (RuntimeError, OSError) as exc:
        if _lost(exc):
            raise StoreLost(
                f"rank {rank}/{size}: the rendezvous store closed the connection at "
                f"{where!r} ({exc})", op="rendezvous", rank=rank, backend="gloo",
            ) from exc
        if _timed_out(exc):
            what = (f"the rendezvous store did not answer rank 0 at {where!r} in time"
                    if rank == 0 else f"rank 0 did not open distcache's adoption (no answer "
                    f"under {where!r}) in time, or completed it before this process came")
            raise CollectiveTimeout(
                f"rank {rank}/{size}: {what} ({exc}); every rank must call distcache.init "
                "(or the same collective) within the timeout",
                op="rendezvous", rank=rank,
            ) from exc
        raise CommError(f"rank {rank}/{size}: the rendezvous store failed at {where!r}: "
                        f"{exc}", op="rendezvous", rank=rank, backend="gloo") from exc


def _get_many(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys``, which all exist, in one round trip where the store can."""
    many = getattr(store, "multi_get", None)
    got = many(keys) if many is not None and keys else [store.get(k) for k in keys]
    return [bytes(value) for value in got]


def _answer_all(store: Any, root: str, size: int, nonce: str, attempt: int,
                until: float) -> int | None:
    """Rank 0's side of every rank's handshake: answer the token each hello holds, read
    every hello again on each pass (its process may have died and another taken the
    rank), until every rank counted itself in with the token its hello holds now; None
    then, else the lowest rank missing when ``until`` passes. The ``arrived`` counter
    (a dead process may have raised it) only says when to look at the count-in keys.
    Keys are looked at (``check``), never waited on: a store client logs each wait that
    times out. Rank ``size``'s hello is answered too: a process holding a larger world
    wrote it, and then fails the meeting.

    Raises:
        CollectiveTimeout: another rank gave up on the meeting meanwhile.
        LaunchError: a rank told the meeting it holds another world size.
    """
    meeting, answer = f"{root}/{nonce}", f"{nonce}:{attempt}:{size}"
    answered: dict[int, str] = {}  # rank -> the token its hello holds
    pause = 0.001
    try:
        while True:
            came = [p for p in range(1, size + 1)
                    if p in answered or store.check([f"{root}/hello/{p}"])]
            for peer, raw in zip(came, _get_many(store, [f"{root}/hello/{p}" for p in came]),
                                 strict=True):
                if peer == size and not _NONCE.fullmatch(raw):
                    continue  # not this world's rank: a foreign value is no concern of ours
                token = parse_nonce(raw, f"{root}/hello/{peer}")
                before = answered.get(peer)
                if before != token:
                    if before is not None:  # an earlier process's: nobody reads it now
                        _forget(store, f"{root}/ack/{peer}/{before}")
                    store.set(f"{root}/ack/{peer}/{token}", answer)
                    answered[peer] = token
            if (int(store.add(f"{meeting}/arrived", 0)) >= size - 1
                    and _missing(store, meeting, size, answered, quick=True) is None):
                return None
            if store.check([f"{meeting}/state"]):  # a rank gave up: say so at once
                _decided(store, meeting, 0, size, bytes(store.get(f"{meeting}/state")))
            left = until - time.monotonic()
            if left <= 0:
                return _missing(store, meeting, size, answered)
            time.sleep(min(pause, left))
            pause = min(pause * 2, _STEP_MAX_S)
    finally:
        beyond = answered.get(size)
        if beyond is not None:
            _forget(store, f"{root}/ack/{size}/{beyond}")


def _missing(store: Any, meeting: str, size: int, answered: dict[int, str], *,
             quick: bool = False) -> int | None:
    """The lowest rank not counted in under ``meeting`` with the token its hello holds
    (``answered``); None when every rank is. ``quick``: 1 where any key is missing."""
    keys = [f"{meeting}/in/{p}" for p in range(1, size)]
    if store.check(keys):
        for peer, raw in zip(range(1, size), _get_many(store, keys), strict=True):
            if raw != answered.get(peer, "").encode():
                return peer
        return None
    if quick:
        return 1
    for peer, key in zip(range(1, size), keys, strict=True):
        if not store.check([key]) or bytes(store.get(key)) != answered.get(peer, "").encode():
            return peer
    return None


def _forget(store: Any, key: str) -> None:
    """Delete ``key`` where the store can (every adoption would otherwise leave keys
    in proportion to the ranks on a store that lives as long as the job)."""
    delete = getattr(store, "delete_key", None)
    if delete is not None:
        with contextlib.suppress(RuntimeError, OSError):
            delete(key)


def _decided(store: Any, meeting: str, rank: int, size: int, outcome: bytes, *,
             missing: int | None = None) -> None:
    """Return if ``outcome`` (the meeting's state) is complete; raise otherwise: it is
    ``abandoned:<rank>``, naming the rank that gave up first, or ``sizes:<rank>:<its
    size>:<rank 0's>``, a rank that holds another world size than rank 0."""
    if outcome == b"complete":
        return
    sizes = _SIZES.fullmatch(outcome)
    if sizes is not None:
        other, theirs, zeros = (int(g) for g in sizes.groups())
        raise LaunchError(
            f"rank {rank}/{size}: rank {other} says WORLD_SIZE={theirs}, rank 0 says "
            f"{zeros}; start every rank of the job with the same world size (WORLD_SIZE or "
            "the launcher's)", variable="WORLD_SIZE", value=str(theirs), rank=rank)
    gave_up = _ABANDONED.fullmatch(outcome)
    if gave_up is None:
        raise CommError(f"the store key {meeting}/state holds {outcome[:80]!r}, not "
                        "distcache's meeting state; something other than distcache wrote "
                        "it", op="rendezvous", rank=rank, backend="gloo")
    first = int(gave_up.group(1))
    who = "this rank" if first == rank else f"rank {first}"
    lacking = f", rank {missing} of {size} not come" if missing is not None else ""
    raise CollectiveTimeout(
        f"rank {rank}/{size}: {who} gave up on distcache's adoption under {meeting!r}"
        f"{lacking}; every rank must call distcache.init (or the same collective) within "
        "the timeout", op="rendezvous", rank=rank,
    )


def _all_came(store: Any, meeting: str, rank: int, size: int, until: float) -> None:
    """A rank but 0: return once rank 0 marked ``meeting`` complete; raise if it, or a
    rank whose deadline passed first (this one included), marked it abandoned. Both
    use ``compare_set`` on one key, so every rank reads the same outcome, and no rank
    dials a gloo address of a peer that gave up.

    Raises:
        CollectiveTimeout: the meeting was abandoned, by this rank or another.
        CommError: the state key holds something else.
    """
    state = f"{meeting}/state"
    try:
        store.wait([state], _wait_for(until))
        outcome = bytes(store.get(state))
    except RuntimeError as exc:
        if not _timed_out(exc):
            raise
        outcome = bytes(store.compare_set(state, "", f"abandoned:{rank}"))
    _decided(store, meeting, rank, size, outcome)


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
