"""Which ranks share a pool: shown by a probe, not assumed from equal ids.

Ranks that report the same ``pool_id`` would share one writer
(:func:`~distcache.collective._plan.elect_writers`), but that id is a file written
when the pool was made, and a copied pool (a container image, an rsync to node-local
disks) keeps it (:mod:`distcache.store._identity`). Two nodes with copies of one
template would each take the other's pool for their own and both report success
holding part of the set. :func:`agree_pools` therefore proves each claim first:

1. An id that one rank reports needs no proof: no probe, no message.
2. Round 1: the lowest rank reporting an id places a probe in its pool (a name and
   content drawn for this run); every other claimant looks for it. Those that find it
   share that rank's directory, and their pool keeps its id.
3. Later rounds, among the claimants that found nothing: their pools are copies. On
   each node the lowest of them renews its pool's id (once: the next run sees
   distinct ids) and places a probe; every claimant looks for each probe placed for
   its id, and the ranks that see the same set of probes form one pool, known by its
   lowest candidate's new id. A candidate sees its own probe, so each round settles
   at least its candidates and the rounds end.

Each round is two all-gathers and every decision is a function of what they carry
(plain lists and dicts), so every rank computes the same pools; a failure is raised
on every rank alike, and all rounds together wait at most ``timeout``. A probe is
removed before its round's result is used, however the round ends. A pool whose probe
cannot be placed (a read-only pool) is a pool of its own for the run: no sharing is
assumed that was not shown.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from distcache._log import get_logger
from distcache.collective._run import Run
from distcache.errors import WireError
from distcache.store import Identity

log = get_logger(__name__)

#: An offer: ``{"id": the pool's id for this run, "name": the probe's name or None
#: when none was placed, "token": its content, "renewed": whether the id is new}``.
Offer = dict[str, Any]


def agree_pools(run: Run, claimed: Sequence[str], node_ids: Sequence[str]) -> list[str]:
    """Collective: per rank, the pool it shares for this run, as a label (the pool's
    id; a fresh one for a copy that was found).

    ``claimed`` is each rank's ``pool_id`` and ``node_ids`` its node, as all-gathered.
    Ranks with equal labels see one directory; give the labels to
    :func:`~distcache.collective._plan.make_plan` in place of the ids.

    Raises:
        CommError: a peer did not arrive within ``run.timeout``.
        PrefetchError: a rank's probe failed unexpectedly (on every rank alike).
    """
    labels = list(claimed)
    counts = Counter(claimed)
    unresolved = [r for r in range(len(claimed)) if counts[claimed[r]] > 1]
    deadline = time.monotonic() + run.timeout
    used = set(claimed)
    proved: set[str] = set()  # ids whose round-1 probe was placed: not seeing it proves a copy
    first = True
    while unresolved:
        candidates: dict[object, int] = {}
        for r in unresolved:
            candidates.setdefault(claimed[r] if first else (claimed[r], node_ids[r]), r)
        chosen = sorted(candidates.values())
        renew = {c for c in chosen if not first and claimed[c] in proved}
        offers, reports = _round(run, claimed, unresolved, chosen, renew, deadline)
        if first:
            proved = {claimed[c] for c in chosen if (offers[c] or {}).get("name") is not None}
        unresolved = _settle(run, claimed, unresolved, offers, reports, labels, used, first)
        first = False
    return labels


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _round(run: Run, claimed: Sequence[str], unresolved: list[int], chosen: list[int],
           renew: set[int], deadline: float) -> tuple[list[Offer | None], list[tuple[int, ...]]]:
    """Collective: the candidates' offers (None for other ranks), and which of them
    each claimant saw."""
    comm, identity, me = run.comm, run.pool.identity, run.comm.rank
    with contextlib.ExitStack() as probes:
        offer: Offer | None = None
        failure = None
        if me in chosen:
            try:
                offer = _offer(probes, identity, claimed[me], renew=me in renew)
            except Exception as exc:
                failure = run.failure("agree", None, exc)
        # Tuples: a payload many ranks send alike ((None, None) from every rank not
        # chosen) is decoded once per rank, not once per sender.
        gathered = comm.allgather_object((offer, failure), timeout=_left(deadline))
        run.raise_first(_pairs(gathered))
        offers: list[Offer | None] = [_offer_of(r, o) for r, (o, _) in enumerate(gathered)]
        seen: list[int] = []
        if me in unresolved:
            for c in chosen:
                o = offers[c]
                if o is not None and claimed[c] == claimed[me] and o["name"] is not None and (
                        c == me or identity.sees(o["name"], o["token"])):
                    seen.append(c)
        reports = comm.allgather_object(tuple(seen), timeout=_left(deadline))
    for rank, report in enumerate(reports):
        if not (type(report) is tuple and all(type(c) is int and c in chosen for c in report)):
            raise _malformed(rank, "report of the probes it saw", report)
    return offers, reports


def _pairs(gathered: Any) -> list[Any]:
    """Each rank's failure of a round's all-gather of (offer, failure) pairs."""
    for rank, pair in enumerate(gathered):
        if not (type(pair) is tuple and len(pair) == 2):
            raise _malformed(rank, "offer", pair)
    return [f for _, f in gathered]


def _offer_of(rank: int, offer: Any) -> Offer | None:
    """``offer`` as rank ``rank`` sent it, checked to be an :data:`Offer` or None."""
    if offer is None or (
            type(offer) is dict and set(offer) == {"id", "name", "token", "renewed"}
            and type(offer["id"]) is str and type(offer["token"]) is str
            and (offer["name"] is None or type(offer["name"]) is str)
            and type(offer["renewed"]) is bool):
        return offer
    raise _malformed(rank, "offer", offer)


def _malformed(rank: int, what: str, value: Any) -> WireError:
    """The error every rank raises alike for what ``rank`` sent (all received it)."""
    return WireError(f"agreeing which ranks share a pool: rank {rank} sent a malformed "
                     f"{what} {value!r:.120}", op="agree", peer=rank, agreed=True)


def _offer(probes: contextlib.ExitStack, identity: Identity, pool_id: str, *,
           renew: bool) -> Offer:
    label, renewed = pool_id, False
    if renew:
        try:
            label, renewed = identity.renew(), True
        except OSError as exc:
            # A read-only copy keeps its id on disk; this run still tells it apart.
            label = os.urandom(16).hex()
            log.warning("the pool %s here is a copy (it did not show the first claimant's "
                        "probe) but cannot take a fresh id: %s; it is %s for this run",
                        pool_id, exc, label)
    name, token = os.urandom(16).hex(), os.urandom(16).hex()
    placed = probes.enter_context(identity.probe(name, token))
    return {"id": label, "name": name if placed else None, "token": token,
            "renewed": renewed}


def _settle(run: Run, claimed: Sequence[str], unresolved: list[int],
            offers: list[Offer | None],
            reports: list[tuple[int, ...]], labels: list[str], used: set[str],
            first: bool) -> list[int]:
    """Pure but for reloading renewed ids: label the pools a round proved; return the
    claimants still unresolved."""
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for r in unresolved:
        groups.setdefault((claimed[r], tuple(reports[r])), []).append(r)
    left: list[int] = []
    for (_pool_id, seen), members in groups.items():
        proven = [c for c in seen if c in members]
        if proven:
            _label(run, proven[0], members, offers, labels, used, first)
            continue
        for r in members:
            if offers[r] is not None:  # a candidate without a probe: a pool of its own
                _label(run, r, [r], offers, labels, used, first)
            else:
                left.append(r)
    return sorted(left)


def _label(run: Run, candidate: int, members: list[int], offers: list[Offer | None],
           labels: list[str], used: set[str], first: bool) -> None:
    offer = offers[candidate]
    assert offer is not None, "every candidate makes an offer"
    label = str(offer["id"])
    if not first:
        if label in used:  # adopted from a concurrent renewal, or a clash: keep apart
            label = f"{label}.{candidate}"
        used.add(label)
    for r in members:
        labels[r] = label
    me = run.comm.rank
    if offer["renewed"] and me in members and me != candidate:
        try:
            run.pool.identity.reload()
        except OSError as exc:
            log.warning("cannot read the renewed id of this rank's pool: %s", exc)
