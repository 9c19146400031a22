"""Moving bytes over the communicator: from one writer's pool to the writers whose
pools lack them, in few, bounded broadcasts (:func:`move_objects`, over the audiences of
:mod:`distcache.collective._audience`), each a bucket of several artifacts
(:mod:`distcache.collective._bucket`).

Within an audience the sources take turns, one bucket each, and a receiver publishes
(hashes and writes) each bucket on a thread while the next one arrives, so every rank
is busy at once; a source builds its next bucket on a thread while the current one
travels (:mod:`distcache.collective._pipeline`). Memory: the sender holds two buckets (one sent, the next built) plus the
artifact that did not fit; a receiver holds at most three buckets (arriving, queued,
being published).
:class:`~distcache.collective._bucket.StreamStats` records the peak of what the protocol held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from distcache.collective._audience import Turns, split_audiences
from distcache.collective._bucket import (
    PAUSE,
    StreamStats,
    bucket_last,
    bucket_messages,
    decode_bucket,
)
from distcache.collective._pipeline import Publisher as _Publisher
from distcache.collective._pipeline import ReadAhead as _ReadAhead
from distcache.collective._plan import Plan
from distcache.comm import Communicator
from distcache.comm._base import lend_broadcast
from distcache.errors import PoolError, WireError
from distcache.store import Pool


class Arrivals(Protocol):
    """The downloads a move runs beside (:class:`~distcache.collective._download.Pending`)."""

    def waiting(self, sha: str) -> bool:
        """Whether ``sha`` is still being downloaded."""

    def landed(self, since: int, seconds: float) -> tuple[list[str], bool]:
        """The objects that landed one by one, from the ``since``-th on (waiting at
        most ``seconds`` for one), and whether every download is over."""


#: How long a source waits for its next object to land before it sends what it has
#: read (an empty bucket if nothing), and the first interval of the empty buckets it
#: sends while it waits on (see :func:`move_objects`).
PATIENCE = 0.01
#: Longest wait between two buckets of a source whose next object is still downloading.
KEEPALIVE_MAX = 1.0
#: The object index of a failure that is no single object's (a failed flush).
NO_OBJECT = -1


def move_objects(
    wcomm: Communicator,
    rank: int,
    plan: Plan,
    pool: Pool,
    *,
    pool_ids: Sequence[str],
    bucket_bytes: int,
    stats: StreamStats,
    timeout: float | None = None,
    on_done: Callable[[int], None] | None = None,
    on_bucket: Callable[[], None] | None = None,
    arrivals: Arrivals | None = None,
    turns: Turns | None = None,
) -> tuple[int, BaseException] | None:
    """Collective over ``wcomm``, the writers' communicator: carry out
    ``plan.audiences`` among the pools' writers. ``rank`` is this writer's rank in
    the communicator the plan was made on.

    Every writer calls it (non-writers take no part). From ``wcomm`` one communicator
    per audience smaller than every writer is split off
    (:func:`distcache.collective._audience.split_audiences`). Within each audience,
    the sources stream their objects from their pools in turns, a bucket each, and
    every other rank of the audience verifies and publishes (``pool.put`` checks the
    digest) those its pool lacks as each bucket arrives. ``on_bucket`` is called after
    every bucket this rank sent or received (progress). A failure does not stop the
    protocol: the rank keeps taking every bucket so its peers stay in step, and
    returns the first ``(object index, error)`` for the caller to agree on (index
    :data:`NO_OBJECT`: the flush failed). A stream that ends without an object this
    rank's pool lacks is such a failure too, and so is a bucket that is malformed or
    names an object outside its source's stream or sent before (thrown away whole),
    and so is an audience whose members' ranks do not arrive as its ranks, each once
    (every member skips it alike and goes on to the next).

    ``arrivals`` (a move that runs beside the downloads into this source's pool)
    says which objects are still downloading and which landed since. A source sends
    the objects it holds first, then each as it lands, whatever the plan's order;
    when nothing lands within :data:`PATIENCE` it sends what it has read, then an
    empty bucket each time its wait runs out (the waits doubling to
    :data:`KEEPALIVE_MAX`), so the other sources' buckets are not held behind its
    downloads and no receiver waits a whole ``timeout`` for a slow download.

    Raises:
        CollectiveTimeout: a peer did not arrive in time.
        WireError: a bucket arrived whose trailer cannot be read (where its
            stream ends is unknown).
    """
    writers = plan.writer_ranks
    mine = pool_ids[rank]
    # The (object index, error) this rank's reader met (the publisher keeps its own).
    failed: list[tuple[int, BaseException]] = []

    keepalive = KEEPALIVE_MAX if timeout is None else min(KEEPALIVE_MAX, timeout / 4)

    def one(index: int) -> tuple[int, bytes | None]:
        data: bytes | None = None
        try:
            # Receivers hash what arrives; an object this process published itself in
            # this run (hashed as it was written) is not hashed again.
            data = pool.get(plan.objects[index], trust_own=True)
            if data is None:
                raise FileNotFoundError(
                    f"object {plan.objects[index]} vanished from pool {mine} (or was corrupt)"
                )
        except Exception as exc:
            failed.append((index, exc))
        return index, data

    def read(indices: tuple[int, ...]) -> Iterator[tuple[int, bytes | None]]:
        # What is not being downloaded goes first, in the plan's order; then each
        # object as it lands, and the rest once every download is over.
        later: dict[str, int] = {}
        for index in indices:
            if arrivals is not None and arrivals.waiting(plan.objects[index]):
                later[plan.objects[index]] = index
            else:
                yield one(index)
        seen, wait = 0, min(keepalive, PATIENCE)
        while later and arrivals is not None:
            landed, over = arrivals.landed(seen, wait)
            seen += len(landed)
            batch = [later.pop(sha) for sha in landed if sha in later]
            if over:
                batch += later.values()
                later = {}
            for index in batch:
                yield one(index)
            if batch:
                wait = min(keepalive, PATIENCE)
            else:
                yield PAUSE, None
                wait = min(keepalive, 2 * wait)

    turns = turns if turns is not None else Turns(rank, plan.audiences, waits=False)
    try:
        comms = split_audiences(wcomm, rank, writers, plan.audiences)
        # What the receivers publish is flushed once: with the batch of the prefetch or
        # sync around this move (in the background), else when the move ends.
        with pool.batch():
            _move(rank, plan, pool, comms, read, mine, bucket_bytes, stats, timeout, failed,
                  on_done, on_bucket, turns)
    except PoolError as exc:  # the batch's flush
        failed.append((NO_OBJECT, exc))
    finally:
        turns.leave()  # over, or failed: no later audience waits for this rank
    return failed[0] if failed else None


def _move(rank: int, plan: Plan, pool: Pool, comms: list[Communicator | None],
          read: Callable[[tuple[int, ...]], Iterator[tuple[int, bytes | None]]], mine: str,
          bucket_bytes: int, stats: StreamStats, timeout: float | None,
          failed: list[tuple[int, BaseException]],
          on_done: Callable[[int], None] | None,
          on_bucket: Callable[[], None] | None, turns: Turns) -> None:
    publisher = _Publisher(pool, plan.objects, stats, on_done)
    # Objects a stream ended without: failures once what did arrive is published.
    missing: list[tuple[int, BaseException]] = []
    try:
        for index, (audience, acomm) in enumerate(zip(plan.audiences, comms, strict=True)):
            if acomm is None:
                continue
            # Wait, while the job makes progress, for the members still busy in earlier
            # audiences (each slice of the wait counts as this rank's progress: the
            # members it waits for answer for their own).
            turns.enter(index, timeout, on_bucket)
            # Learn the audience communicator's rank order rather than assume it.
            world_of = acomm.allgather_object(rank, timeout=timeout)
            try:
                root_of = _roots(rank, audience.ranks, world_of)
            except WireError as exc:
                # Every member received the same answer, so every member skips this
                # audience alike and the later ones stay in step; the move fails when
                # it ends, on every rank (members or not) through the usual agreement.
                missing.append((NO_OBJECT, exc))
                continue
            # The sources take turns, one bucket each, until each has sent its last:
            # every rank receives while it publishes, instead of one source at a time
            # keeping the others idle. Every rank sees the same "last" flags, so all
            # take the same turns.
            outgoing = {source: _ReadAhead(bucket_messages(read(indices),
                                                           bucket_bytes=bucket_bytes,
                                                           stats=stats))
                        for source, indices in audience.sends if source == rank}
            try:
                missing += _take_turns(rank, audience.sends, acomm, root_of, outgoing,
                                       publisher, plan, mine, stats, timeout, on_bucket)
            finally:
                for ahead in outgoing.values():
                    ahead.close()
    finally:
        publisher.close()
        failed.extend(publisher.failed)
        failed.extend(missing)


def _roots(rank: int, ranks: tuple[int, ...], world_of: object) -> dict[int, int]:
    """Per rank of an audience (``ranks``), its rank in the audience's communicator,
    from what the members all-gathered there (each its own rank), checked to be
    exactly the audience's ranks, each once.

    Raises:
        WireError: the answer is not one rank per member, or a member sent something
            other than a rank of the audience no other member sent (the split keeps
            the ranks' order, so the member at position ``i`` is ``ranks[i]``). Every
            member received the same answer and raises alike.
    """
    if type(world_of) is not list or len(world_of) != len(ranks):
        raise WireError(f"rank {rank}: the audience of ranks {list(ranks)} answered "
                        f"{world_of!r:.120} for its members' ranks", op="stream", rank=rank)
    members = set(ranks)
    root_of: dict[int, int] = {}
    for sub, world in enumerate(world_of):
        if type(world) is not int or world not in members:
            why = "which is not one of the audience's ranks"
        elif world in root_of:
            why = f"which member {root_of[world]} sent too"
        else:
            root_of[world] = sub
            continue
        raise WireError(f"rank {rank}: rank {ranks[sub]} (member {sub} of the audience of "
                        f"ranks {list(ranks)}) sent {world!r:.40} for its rank, {why}",
                        op="stream", rank=rank, peer=ranks[sub])
    return root_of


def _take_turns(rank: int, sends: Sequence[tuple[int, tuple[int, ...]]],
                acomm: Communicator, root_of: dict[int, int], outgoing: dict[int, _ReadAhead],
                publisher: _Publisher, plan: Plan, mine: str, stats: StreamStats,
                timeout: float | None, on_bucket: Callable[[], None] | None,
                ) -> list[tuple[int, BaseException]]:
    """One audience's turns; returns, per other source whose stream ended without an
    object this rank's pool lacks, the first such object and its error."""
    missing: list[tuple[int, BaseException]] = []
    active = [source for source, _ in sends]
    # Per other source, the objects of its stream not arrived yet (each arrives once)
    # and of those the ones this rank's pool lacks: each must arrive, as bytes or as
    # an entry its source could not read (and reports).
    unsent = {source: set(indices) for source, indices in sends if source != rank}
    owed = {source: {i for i in indices if mine in plan.lacking[i]}
            for source, indices in sends if source != rank}
    while active:
        for source in list(active):
            # The root lends its message and receivers own theirs: no copies.
            message: bytes | bytearray
            if source == rank:
                message = next(outgoing[source])
                lend_broadcast(acomm, message, root_of[source], timeout=timeout)
            else:
                message = lend_broadcast(acomm, None, root_of[source], timeout=timeout)
                publisher.arrived(len(message))
            last, entries, rejected = _decode(message, rank, source, unsent.get(source, set()), plan)
            if rejected is not None:  # agreed when the move ends: the rank stays in step
                missing.append(rejected)
            if last:
                active.remove(source)
            if source != rank:
                owed[source].difference_update(index for index, _ in entries)
                if last and owed[source]:
                    index = min(owed[source])
                    missing.append((index, WireError(
                        f"rank {rank}: the stream of rank {source} ended without object "
                        f"{plan.objects[index]}", op="stream", rank=rank, peer=source)))
                publisher.submit(_wanted(entries, plan, mine, stats), len(message))
            del message, entries
            if on_bucket is not None:
                on_bucket()
    return missing


def _decode(message: bytes | bytearray, rank: int, source: int, unsent: set[int],
            plan: Plan) -> tuple[bool, list[tuple[int, memoryview | None]],
                                 tuple[int, BaseException] | None]:
    """``(last, entries, rejection)`` of a bucket from ``source``, whose entries are struck
    off ``unsent`` (another rank's). A bucket whose table is malformed, or names an
    object outside the stream or sent before, is rejected: no entries, and the first
    such object (:data:`NO_OBJECT`: none known) with the error.

    Raises:
        WireError: the trailer cannot be read (where the stream ends is unknown).
    """
    def malformed(reason: object) -> WireError:
        return WireError(f"rank {rank}: rank {source} sent a malformed bucket: {reason}",
                         op="stream", rank=rank, peer=source)

    try:
        last, entries = decode_bucket(message, len(plan.objects))
    except WireError as exc:
        try:
            return bucket_last(message), [], (NO_OBJECT, malformed(exc))
        except WireError:
            raise malformed(exc) from None
    for index, _ in entries if source != rank else ():
        if index not in unsent:
            return last, [], (index, malformed(
                f"the bucket names object {plan.objects[index]}, which is not in its "
                "stream or was sent before"))
        unsent.discard(index)
    return last, entries, None


def _wanted(entries: list[tuple[int, memoryview | None]], plan: Plan, mine: str,
            stats: StreamStats) -> list[tuple[int, memoryview]]:
    """The received entries this rank's pool lacks (a missing entry is reported by its
    source; one its pool holds is counted and thrown away)."""
    keep = []
    for index, view in entries:
        if view is None:
            continue
        stats.received_bytes += len(view)
        if mine not in plan.lacking[index]:
            # Only objects past the audience cap reach a pool that has them.
            stats.discarded_bytes += len(view)
            continue
        keep.append((index, view))
    return keep
