"""What :func:`~distcache.collective.prefetch` and :func:`~distcache.collective.sync`
share: one rank's side of a collective (:class:`Run`: phase timings, counters, the
download and move steps, and failure agreement) and the discovery of what each pool
holds.

Failure is collective: a rank that fails records ``(phase, artifact, rank, host,
cause)`` and carries on with the protocol; at the next boundary every rank raises the
same :class:`~distcache.errors.PrefetchError`, built from the lowest failing rank's
record. (:func:`distcache.comm.agree_on_error` re-raises each failing rank's *own*
error; with two failing ranks that would not be the same error everywhere.) A
:class:`~distcache.errors.CommError` (a peer that never arrives, a failed backend) is
turned into the same kind of error by :meth:`Run.guarded`.

Deadlines tell absence from slowness. ``timeout`` (``DISTCACHE_TIMEOUT``) bounds
every wait for a peer: a collective that a peer does not enter within ``timeout``
fails on every rank that waits. It does not bound how long work may take while it
makes progress. In the fetch phase (:meth:`Run.fetch`) every rank enters a small
all-gather at least every ``min(1 s, timeout / 4)`` (a heartbeat; a rank whose
downloads are over enters at once), carrying whether its downloads are over and how
long ago its last progress was (a byte arriving from the origin, an artifact
published). The phase ends when every rank's downloads are over: at once on every rank
when one rank's origin or pool failed (not one artifact). It fails, on every
rank alike, when a rank's downloads made no progress for ``timeout`` seconds (the
lowest such rank is named: "the origin is stalling"), or when a rank misses a
heartbeat by ``timeout`` (a peer that is gone, stopped or stuck: ``CollectiveTimeout``).
So a slow, steady origin may take as long as it needs, and a silent one or a silent
peer is reported within ``timeout`` plus one heartbeat. The move phase (:meth:`Run.move`)
follows the same rule: the writers move buckets on a thread while every rank, taking
part or not, beats the heart (:mod:`distcache.collective._heartbeat`). A prefetch
starts that thread before its downloads (:meth:`Run.start_move`), so objects travel
as they land, and its move phase is what is left of the move when the fetch ends.
Those heartbeats also give each writer its turn in an audience whose members are busy
in earlier ones (:class:`~distcache.collective._audience.Turns`): it waits for them as
long as the job makes progress, not one ``timeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.collective._audience import Turns
from distcache.collective._bucket import StreamStats
from distcache.collective._heartbeat import (
    Activity,
    Failure,
    Worker,
    concurrent,
    heartbeats,
    primary,
    sent_failures,
)
from distcache.collective._plan import Plan, decode_bitmap, elect_writers, encode_bitmap
from distcache.collective._progress import Progress
from distcache.collective._report import PHASES
from distcache.comm import Communicator, tell_others
from distcache.config import Settings, settings
from distcache.errors import ArtifactNotFound, CommError, PrefetchError
from distcache.origins import Origin
from distcache.store import Pool

if TYPE_CHECKING:
    from distcache.collective._download import Downloads, Pending
    from distcache.collective._stream import Arrivals

log = get_logger(__name__)


def own_settings(comm: Communicator, **given: Any) -> Settings:
    """A collective's :func:`~distcache.config.settings`: a bad one raises here, on this
    rank alone, and is told to the others first (they would wait for this rank in the
    collective's first round until their timeout)."""
    try:
        return settings(**given)
    except BaseException as exc:
        tell_others(comm, exc)
        raise

_T = TypeVar("_T")

#: The colors of the move's split: the writers and the rest (see :meth:`Run.move`).
MOVE_COLORS = (0x4D56, 0x4D57)


#: A move started beside the fetch (:meth:`Run.start_move`): its thread, activity and
#: turns.
Moving = tuple[Worker, Activity, Turns]

#: Names the origin may lack, which the caller of this context's collectives leaves out.
HINTS: ContextVar[frozenset[str]] = ContextVar("distcache_hints", default=frozenset())


class Run:
    """One rank's side of one collective: timings, counters, error agreement."""

    def __init__(self, operation: str, comm: Communicator, pool: Pool, timeout: float) -> None:
        self.operation = operation
        self.comm = comm
        self.pool = pool
        self.timeout = timeout
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.stream = StreamStats()
        self.downloads = 0
        #: Downloads skipped because the object reached the pool meanwhile.
        self.placed = 0
        self.origin_bytes = 0
        #: The turns of the move running beside the fetch, told by its heartbeats.
        self._turns: Turns | None = None
        #: Rank 0's bar on a terminal (see ``_progress``); a no-op elsewhere.
        self.progress = Progress(0, enabled=False)
        self.hints = HINTS.get()  # read where the collective starts, not on its threads

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] += time.monotonic() - start

    def failure(self, phase: str, artifact: str | None, exc: BaseException) -> Failure:
        """This rank's failure, logged at ERROR (INFO for a hint the origin lacks)."""
        cause = f"{type(exc).__name__}: {exc}"
        hint = (phase == "fetch" and artifact in self.hints
                and cause.startswith(f"{ArtifactNotFound.__name__}: "))
        (log.info if hint else log.error)("%s %s failed on rank %d for %s: %s",
                                          self.operation, phase, self.comm.rank, artifact, cause)
        return (phase, artifact, self.comm.rank, self.comm.node_id, cause)

    def raise_first(self, failures: Iterable[Failure | None]) -> None:
        found = sent_failures(failures, self.operation)
        if not found:
            return
        phase, artifact, rank, host, cause = primary(found)
        what = artifact if artifact is not None else "(no single artifact)"
        raise PrefetchError(
            f"{self.operation} failed in {phase} on rank {rank}/{self.comm.size} ({host}) "
            f"for {what}: {cause}",
            artifact=artifact,
            rank=rank,
            host=host,
            cause=cause,
            phase=phase,
            agreed=True,  # every rank raises this one, built from the same records
        )

    def check(self, failure: Failure | None) -> None:
        """Collective: raise the same PrefetchError on every rank if any rank failed."""
        self.raise_first(self.comm.allgather_object(failure, timeout=self.timeout))

    def guarded(self, body: Callable[[], _T]) -> _T:
        try:
            return body()
        except CommError as exc:  # a transport's failure: every rank meets its own
            if getattr(exc, "agreed", False):  # what every rank received alike, said alike
                raise PrefetchError(f"{self.operation} failed: {exc}", artifact=None,
                                    rank=getattr(exc, "peer", None), host=None,
                                    cause=f"{type(exc).__name__}: {exc}", phase="collective",
                                    agreed=True) from exc
            rank, host = self.comm.rank, self.comm.node_id
            raise PrefetchError(
                f"{self.operation} failed on rank {rank}/{self.comm.size} ({host}): {exc}; "
                f"a peer did not arrive or its backend failed",
                artifact=None,
                rank=rank,
                host=host,
                cause=f"{type(exc).__name__}: {exc}",
                phase="collective",
            ) from exc
        except BaseException as exc:  # this rank's own: the others would wait it out
            tell_others(self.comm, exc)
            raise

    # -- durability ----------------------------------------------------------------

    @contextmanager
    def durable(self) -> Iterator[None]:
        """One pool batch around a prefetch's fetch and move (a sync's move): what they
        publish is written back every 64 MiB as it goes and flushed when the body
        ends, on a thread of its own, whose failure is logged, not raised. A rank never
        waits on a ``syncfs`` that may be flushing other programs' writes too; every
        read is verified, so durability is not what makes an object correct."""
        with self.pool.batch(wait=False):
            yield

    # -- fetch ---------------------------------------------------------------------

    def fetch(self, artifacts: list[Artifact], origin: Origin, workers: int,
              pending: Pending | None = None) -> None:
        """Collective, entered by every rank when the plan has downloads: download this
        rank's ``artifacts`` (maybe none) with ``workers`` threads, beating the heart
        while they run, then raise the same error on every rank if any rank failed or
        stalled (the rule: the module docstring). ``pending`` learns each artifact
        settled (a move running beside the downloads sends them as they land), and all
        of them when this returns or raises.

        Raises:
            PrefetchError: a download failed or made no progress for ``timeout`` on
                some rank (on every rank).
            CommError: a peer missed a heartbeat by ``timeout``.
        """
        # Loaded by the runs that download (a warm start has nothing to fetch).
        from distcache.collective._download import Downloads, offline_refusal, stall_message

        failure: Failure | None = None
        job: Downloads | None = None
        if artifacts and settings().offline:
            # No request from any path: a caller that handed the collective an origin
            # anyway gets one failure for this rank's share, agreed on like any other.
            failure = self.failure("fetch", artifacts[0].name, offline_refusal(artifacts))
        elif artifacts:  # started in the caller's batch (:meth:`durable`)
            job = Downloads(self.pool, origin, artifacts, workers=workers,
                            on_done=self.progress.update, pending=pending).start()

        # A failure of the origin or the pool (not one artifact's) ends this rank's
        # downloads at once and, told by the beats, every other rank's: the phase fails
        # then, not when the last rank has fetched its whole share.
        halting = failure is not None

        def finish() -> None:  # the downloads' figures, frozen: what still runs stops
            nonlocal job, failure, halting
            if job is not None:
                halting, got, job = job.fatal(), job.abandon(), None
                self.downloads += got.downloads
                self.placed += got.placed
                self.origin_bytes += got.origin_bytes
                if got.failure is not None:
                    failure = self.failure("fetch", *got.failure)

        def step(beat: float) -> tuple[bool, float, Any, Failure | None]:
            done = job is None or job.wait(beat) or job.fatal()
            if done:
                finish()
            running = job.running() if job is not None else []
            idle = 0.0 if job is None else job.idle()
            return done, idle, (running[0] if running else None, origin.describe()), failure

        def stalled(rank: int, idle: float, detail: Any, host: str) -> Failure:
            name, label = detail
            where = f"rank {rank}/{self.comm.size} ({host})"
            return ("fetch", name, rank, host, "OriginError: " + stall_message(
                name or "(queued)", label, self.timeout, idle, where))

        try:
            heartbeats(self.comm, self.timeout, step, self.raise_first, stalled, self._turns,
                       halt=(lambda: halting, lambda: job is None or job.abandon()))
        finally:
            finish()
            if pending is not None:
                pending.settle()

    # -- move ----------------------------------------------------------------------

    def move(
        self, plan: Plan, pool_ids: list[str], name_of: Mapping[str, str], bucket_bytes: int
    ) -> Failure | None:
        """Collective, entered by every rank when the plan has sends: the pools' writers
        move the objects among themselves (:func:`move_objects`) on a thread, over a
        communicator of their own, while every rank beats the heart on this one, as in
        the fetch phase. So a rank that takes no part (not a writer, or a writer
        outside every audience) waits as long as the move makes progress (a bucket
        sent, received or published on some rank) and fails, with every rank, when a
        rank's move made no progress for ``timeout`` or a rank misses a heartbeat.
        Returns this rank's failure (the caller agrees on it with :meth:`check`).
        """
        if not concurrent(self.comm):
            # The transport cannot take two threads: the move runs here, and a rank
            # outside it waits for its end within one timeout.
            # What the move raises (a malformed bucket, a peer's timeout) is this rank's
            # failure, agreed on like the concurrent move's.
            work, _, _ = self._move_work(plan, pool_ids, bucket_bytes, None, beside=False)
            try:
                failed = work() if work is not None else None
            except Exception as exc:
                return self.failure("move", None, exc)
            return None if failed is None else self._moved(plan, name_of, failed)
        self.finish_move(self.start_move(plan, pool_ids, bucket_bytes), plan, name_of)
        return None

    def start_move(self, plan: Plan, pool_ids: list[str], bucket_bytes: int,
                   arrivals: Arrivals | None = None) -> Moving:
        """Collective: start :meth:`move`'s work on its thread and return at once (the
        caller may run the fetch meanwhile; ``arrivals``: ``move_objects``'s, the
        fetch's :class:`Pending`); :meth:`finish_move` waits for it. Only where
        :func:`concurrent` holds."""
        work, activity, turns = self._move_work(plan, pool_ids, bucket_bytes, arrivals)
        self._turns = turns
        return Worker("move", work), activity, turns

    def finish_move(self, moving: Moving, plan: Plan, name_of: Mapping[str, str]) -> None:
        """Collective: beat the heart until every rank's move started by
        :meth:`start_move` is over; raise the agreed error if one failed or stalled
        (at once: a move that made no progress for ``timeout`` is not waited for
        again; its thread ends on its own, its waits bounded by the timeout)."""
        worker, activity, turns = moving
        failure: list[Failure | None] = []  # this rank's, once its move is over

        def step(beat: float) -> tuple[bool, float, Any, Failure | None]:
            done = worker.wait(beat)
            if done and not failure:
                failure.append(
                    None if worker.error is None and worker.result is None
                    else self.failure("move", None, worker.error) if worker.error is not None
                    else self._moved(plan, name_of, worker.result))
            return done, activity.idle(), None, failure[0] if failure else None

        def stalled(rank: int, idle: float, _: Any, host: str) -> Failure:
            where = f"rank {rank}/{self.comm.size} ({host})"
            return ("move", None, rank, host,
                    f"CollectiveTimeout: the move made no progress for {idle:.0f} s on "
                    f"{where} (timeout {self.timeout:g} s): a peer or its pool is stuck")

        try:
            heartbeats(self.comm, self.timeout, step, self.raise_first, stalled, turns)
        except BaseException:
            worker.join(0.0)
            raise
        finally:
            self._turns = None
        worker.join(self.timeout)

    def _move_work(
        self, plan: Plan, pool_ids: list[str], bucket_bytes: int,
        arrivals: Arrivals | None, *, beside: bool = True,
    ) -> tuple[Callable[[], tuple[int, BaseException] | None] | None, Activity, Turns]:
        """Collective (the split): this rank's part of the move (``None``: not a
        writer), the activity it touches and its turns (``beside``: heartbeats run
        beside the move and tell them)."""
        # Loaded by the runs that move objects (a warm start has nothing to send).
        from distcache.collective._stream import move_objects

        is_writer = self.comm.rank in plan.writer_ranks
        # Always a communicator of the writers' own, even when every rank writes: the
        # heartbeats run on this one at the same time. Colors of its own, too: split
        # keeps one child per partition, and a node tree over this communicator may
        # keep its leaders as split(0 if leader else 1), the same ranks as the writers
        # when each node has one pool; that child is busy with the heartbeats.
        wcomm = self.comm.split(MOVE_COLORS[0] if is_writer else MOVE_COLORS[1])
        activity = Activity()
        turns = Turns(self.comm.rank, plan.audiences, waits=beside)

        def published(nbytes: int) -> None:
            activity.touch()
            self.progress.update(nbytes)

        def work() -> tuple[int, BaseException] | None:
            # On the move's thread, a batch of that thread's own, like the caller's
            # (durable): what the move publishes is flushed in the background.
            with self.pool.batch(wait=False):
                return move_objects(wcomm, self.comm.rank, plan, self.pool, pool_ids=pool_ids,
                                    bucket_bytes=bucket_bytes, stats=self.stream,
                                    timeout=self.timeout, on_done=published,
                                    on_bucket=activity.touch, arrivals=arrivals,
                                    turns=turns)

        return (work if is_writer else None), activity, turns

    def _moved(self, plan: Plan, name_of: Mapping[str, str],
               failed: tuple[int, BaseException]) -> Failure:
        if failed[0] < 0:  # not one object's failure (the flush of what was published)
            return self.failure("move", None, failed[1])
        sha = plan.objects[failed[0]]
        return self.failure("move", name_of.get(sha, sha), failed[1])


def discover(run: Run, objects: list[str], pool_ids: list[str]) -> dict[str, list[bool]]:
    """Collective: every pool's writer reports which ``objects`` its pool holds."""
    writers = elect_writers(pool_ids)
    payload: bytes | None = None
    failure: Failure | None = None
    if writers[pool_ids[run.comm.rank]] == run.comm.rank:
        try:
            payload = encode_bitmap(run.pool.holding(objects))
        except Exception as exc:
            failure = run.failure("discover", None, exc)
    gathered = run.comm.allgather_object((payload, failure, run.comm.node_id),
                                         timeout=run.timeout)
    run.raise_first(g[1] if type(g) is tuple and len(g) == 3 else (
        "discover", None, r, "?", f"WireError: rank {r} sent a malformed have-set record")
        for r, g in enumerate(gathered))
    have: dict[str, list[bool]] = {}
    for p, w in writers.items():
        # Every rank decodes the same gathered payloads: a malformed one fails alike.
        bitmap = gathered[w][0]
        try:
            if not isinstance(bitmap, bytes):
                raise ValueError(f"a have-set of type {type(bitmap).__name__}")
            have[p] = decode_bitmap(bitmap, len(objects))
        except ValueError as exc:
            run.raise_first([("discover", None, w, str(gathered[w][2]),
                              f"WireError: rank {w} sent a malformed have-set for its "
                              f"pool: {exc}")])
    return have
