"""The collective prefetch and sync: agree -> discover -> plan -> fetch once -> move ->
publish.

Every rank calls :func:`prefetch` (or :func:`sync`) with the same arguments; each
missing artifact is fetched from the origin by exactly one rank and its bytes move
over the communicator to the pools that lack it. The sequence of collectives each
rank enters depends only on all-gathered data, so every rank takes the same path and
no rank can wait on a collective the others skip:

=========  ==========================================================  ===========
phase      what happens                                                collective
=========  ==========================================================  ===========
agree      digest of the sorted artifact list (sizes included), the    allgather;
           download counts (the smallest of each is planned with),     two per
           pool id and node id; ranks claiming one pool id prove they  probe round
           see one directory (a probe file; a copy takes a fresh id:
           ``_sharing``)
discover   each pool's writer reports a have-bitmap over the list      allgather
plan       pure: the same plan on every rank (``_plan``)               none
fetch      each missing object is downloaded by exactly one rank,      allgather
           into its own pool (``downloads_per_rank`` threads,          (if any
           ``_download``); then errors are agreed on                   download)
move       writers stream buckets from each source's pool to the       splits,
           writers whose pools lack them (one communicator per         broadcasts,
           audience, ``_audience``), who verify and publish as each    allgathers
           bucket arrives (``_stream``); then errors are agreed on
publish    writers record names; one allgather combines every rank's   allgather
           figures into the report (and is the final barrier)
=========  ==========================================================  ===========

:func:`sync` skips the fetch: it discovers what the pools' journals gained and moves
it. Failure is collective (``_run``): every rank raises the same
:class:`~distcache.errors.PrefetchError`, built from the lowest failing rank's record;
a peer that never arrives makes each waiting rank raise ``PrefetchError`` caused by
``CollectiveTimeout`` within ``timeout``. Publication is atomic, so a failed run
leaves whole objects only, and the next call resumes from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distcache.collective._report import PHASES, PrefetchReport

if TYPE_CHECKING:
    from distcache.collective._prefetch import prefetch
    from distcache.collective._sync import SyncState, sync

__all__ = ["PHASES", "PrefetchReport", "SyncState", "prefetch", "sync"]


def __getattr__(name: str) -> Any:
    # Each loads with its first use: a start-up prefetches, it does not sync, and a
    # node member whose leader prefetches for it only reads the report.
    if name == "prefetch":
        from distcache.collective import _prefetch

        return _prefetch.prefetch
    if name not in ("SyncState", "sync"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from distcache.collective import _sync

    return getattr(_sync, name)
