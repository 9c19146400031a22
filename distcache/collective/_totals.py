"""The collective's closing step: every rank's figures summed into one report.

Each rank contributes its counters, its phase timings and its failure (if any); they
are combined with :func:`~distcache.comm.reduce_object`: sums, maxima, the ranks that
downloaded, and the lowest failing rank's failure. Through node leaders that is one
combined entry per node, so what a rank receives does not grow with the ranks of the
job, and every rank builds the same :class:`~distcache.collective._report.PrefetchReport`
(or raises the same error).
"""

from __future__ import annotations

from typing import Any

from distcache._events import emit
from distcache._log import get_logger
from distcache.collective._heartbeat import primary, sent_failures
from distcache.collective._plan import Plan
from distcache.collective._report import PHASES, PrefetchReport
from distcache.collective._run import Failure, Run
from distcache.comm import reduce_object
from distcache.errors import WireError

log = get_logger(__name__)

_SUMMED = ("downloads", "origin_bytes", "broadcasts", "broadcast_bytes", "received_bytes",
           "discarded_bytes", "published")


#: The keys of every entry, each rank's and each combination's.
_KEYS = frozenset((*_SUMMED, "peak", "seconds", "downloaders", "failure"))


def combine(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry for ``entries``: combining partial results gives the same entry as
    combining them all at once.

    Raises:
        WireError: an entry is not of this shape (naming it by its place: rank ``i``
            sent entry ``i`` where every rank's entry is combined at once). Every rank
            combines the same entries, so every rank raises it alike.
    """
    for place, entry in enumerate(entries):
        _check(place, entry)
    failures = [e["failure"] for e in entries if e["failure"] is not None]
    return {
        **{key: sum(e[key] for e in entries) for key in _SUMMED},
        "peak": max(e["peak"] for e in entries),
        "seconds": {p: max(e["seconds"][p] for e in entries) for p in PHASES},
        "downloaders": sorted(r for e in entries for r in e["downloaders"]),
        "failure": primary(failures) if failures else None,
    }


def _check(place: int, entry: Any) -> None:
    """Raise a WireError naming ``place`` unless ``entry`` is one rank's figures or a
    combination of them."""
    if not _well_formed(entry):
        raise WireError(f"totals: entry {place} of the figures combined (rank {place}'s "
                        f"where every rank's entry is combined at once) is malformed: "
                        f"{entry!r:.120}", op="totals", peer=place,
                        agreed=True)  # every rank combines the same entries


def _well_formed(entry: Any) -> bool:
    if not (type(entry) is dict and set(entry) == _KEYS):
        return False
    seconds, downloaders, failure = entry["seconds"], entry["downloaders"], entry["failure"]
    if not (all(type(entry[key]) is int for key in (*_SUMMED, "peak"))
            and type(seconds) is dict
            and all(type(seconds.get(p)) in (int, float) for p in PHASES)
            and type(downloaders) is list and all(type(r) is int for r in downloaders)):
        return False
    try:
        sent_failures([failure], "totals")  # None, or a failure record
    except WireError:
        return False
    return True


def finish(run: Run, plan: Plan, artifacts: int, failure: Failure | None) -> PrefetchReport:
    """Collective: the same report on every rank (the collective's final step), or the
    same error when any rank passes a ``failure``.

    Raises:
        PrefetchError: some rank failed (the lowest failing rank's failure).
    """
    comm = run.comm
    mine = {
        "downloads": run.downloads,
        "origin_bytes": run.origin_bytes,
        "broadcasts": run.stream.broadcasts,
        "broadcast_bytes": run.stream.bytes_sent,
        "received_bytes": run.stream.received_bytes,
        "discarded_bytes": run.stream.discarded_bytes,
        # Every download is published into this rank's pool, and so is every object a
        # download was skipped for because it got there meanwhile.
        "published": run.downloads + run.placed + run.stream.published,
        "peak": run.stream.peak_bytes,
        "seconds": dict(run.seconds),
        "downloaders": [comm.rank] if run.downloads else [],
        "failure": failure,
    }
    total = reduce_object(comm, mine, combine, timeout=run.timeout)
    run.raise_first([total["failure"]])
    report = PrefetchReport(
        operation=run.operation,
        artifacts=artifacts,
        objects=len(plan.objects),
        downloads=total["downloads"],
        origin_bytes=total["origin_bytes"],
        broadcasts=total["broadcasts"],
        broadcast_bytes=total["broadcast_bytes"],
        received_bytes=total["received_bytes"],
        discarded_bytes=total["discarded_bytes"],
        pool_hits=plan.hits,
        objects_published=total["published"],
        pools=len(plan.pools),
        writers=plan.writer_ranks,
        downloaders=tuple(total["downloaders"]),
        peak_bytes=total["peak"],
        seconds=dict(total["seconds"]),
    )
    run.progress.close()
    if comm.rank != 0:
        # Rank 0's caller prints the summary (the session logs it, the CLI writes it
        # on stdout): with -v every rank shows it once, rank 0 too.
        log.debug("%s", report.summary())
    else:
        emit(f"{run.operation}.report", ranks=comm.size, node=comm.node_id,
             **report.as_dict())
    return report
