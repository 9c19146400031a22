"""The collective: agree -> discover -> plan -> fetch once -> move -> publish.

Every rank calls :func:`prefetch` (or :func:`sync`) with the same arguments. The
sequence of collectives each rank enters depends only on all-gathered data, so every
rank takes the same path and no rank can wait on a collective the others skip:

=========  ============================================================  ==========
phase      what happens                                                   collective
=========  ============================================================  ==========
agree      digest of the sorted artifact list, pool id and node id        allgather
discover   each pool's writer reports a have-bitmap over the list         allgather
plan       pure: :func:`distcache.collective._plan.make_plan` on every rank           none
fetch      each missing object is downloaded by exactly one rank, into    allgather
           its own pool (``downloads_per_rank`` threads); then errors     (if any
           are agreed on                                                  download)
move       writers stream buckets from each source's pool to the          splits,
           writers whose pools lack them (one communicator per            broadcasts,
           audience), who verify and publish as each bucket arrives;      allgathers
           then errors are agreed on
publish    writers record names; one allgather combines every rank's      allgather
           figures into the report (and is the final barrier)
=========  ============================================================  ==========

Failure is collective: a rank that fails records ``(phase, artifact, rank, host,
cause)`` and carries on with the protocol; at the next boundary every rank raises the
same :class:`~distcache.errors.PrefetchError`, built from the lowest failing rank's
record. (:func:`distcache.comm.agree_on_error` re-raises each failing rank's *own*
error; with two failing ranks that would not be the same error everywhere.) A peer
that never arrives makes each waiting rank raise ``PrefetchError`` caused by
``CollectiveTimeout`` within ``timeout``. Publication is atomic, so a failed run
leaves whole objects only, and the next call resumes from them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from distcache.artifact import Artifact, manifest_text
from distcache.collective._plan import Plan, decode_bitmap, elect_writers, encode_bitmap, make_plan
from distcache.collective._report import PHASES, PrefetchReport
from distcache.collective._transfer import Origin as _Origin
from distcache.collective._transfer import StreamStats, download_objects, move_objects
from distcache.comm._base import Communicator
from distcache.config import settings
from distcache.errors import CommError, ManifestError, ManifestMismatchError, PrefetchError

__all__ = ["PHASES", "PrefetchReport", "SyncState", "prefetch", "sync"]

log = logging.getLogger(__name__)

# Share of the collective timeout a rank may spend on its downloads (see _Run.download).
_FETCH_SHARE = 0.75

# (phase, artifact name or None, rank, host, "Type: message")
_Failure = tuple[str, str | None, int, str, str]
_T = TypeVar("_T")


class _Pool(Protocol):
    """The part of :class:`distcache.store._pool.ArtifactPool` the collective uses."""

    @property
    def pool_id(self) -> str: ...
    def has(self, sha256: str) -> bool: ...
    def get(self, sha256: str) -> bytes | None: ...
    def put(self, data: bytes | bytearray | memoryview, sha256: str | None = None) -> str: ...
    def remember(self, artifacts: Iterable[Artifact]) -> None: ...
    def names(self) -> dict[str, str]: ...
    def journal_since(self, cursor: int = 0) -> tuple[list[str], int]: ...


@dataclass
class SyncState:
    """Where the previous :func:`sync` left each pool's journal (owned by the caller,
    e.g. a session). Without one, every sync compares whole journals: correct, but it
    sends every object id each time."""

    cursors: dict[str, int] = field(default_factory=dict)


class _Run:
    """One rank's side of one collective: timings, counters, error agreement."""

    def __init__(self, operation: str, comm: Communicator, pool: _Pool, timeout: float) -> None:
        self.operation = operation
        self.comm = comm
        self.pool = pool
        self.timeout = timeout
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.stream = StreamStats()
        self.downloads = 0
        self.origin_bytes = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] += time.monotonic() - start

    def failure(self, phase: str, artifact: str | None, exc: BaseException) -> _Failure:
        cause = f"{type(exc).__name__}: {exc}"
        log.error(
            "%s %s failed on rank %d for %s: %s",
            self.operation,
            phase,
            self.comm.rank,
            artifact,
            cause,
        )
        return (phase, artifact, self.comm.rank, self.comm.node_id, cause)

    def raise_first(self, failures: Iterable[_Failure | None]) -> None:
        found = [f for f in failures if f is not None]
        if not found:
            return
        phase, artifact, rank, host, cause = min(found, key=lambda f: f[2])
        what = artifact if artifact is not None else "(no single artifact)"
        raise PrefetchError(
            f"{self.operation} failed in {phase} on rank {rank}/{self.comm.size} ({host}) "
            f"for {what}: {cause}",
            artifact=artifact,
            rank=rank,
            host=host,
            cause=cause,
            phase=phase,
        )

    def check(self, failure: _Failure | None) -> None:
        """Collective: raise the same PrefetchError on every rank if any rank failed."""
        self.raise_first(self.comm.allgather_object(failure, timeout=self.timeout))

    def guarded(self, body: Callable[[], _T]) -> _T:
        try:
            return body()
        except CommError as exc:
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

    # -- fetch ---------------------------------------------------------------------

    def download(self, artifacts: list[Artifact], origin: _Origin, workers: int) -> _Failure | None:
        # Peers entered the agreement that follows when these downloads started, and
        # wait ``timeout`` there: a budget short of theirs lets this rank's failure
        # reach them in time, so that every rank raises the same error.
        got = download_objects(
            self.pool, origin, artifacts, workers=workers, timeout=self.timeout * _FETCH_SHARE
        )
        self.downloads += got.downloads
        self.origin_bytes += got.origin_bytes
        return None if got.failure is None else self.failure("fetch", *got.failure)

    # -- move ----------------------------------------------------------------------

    def move(
        self, plan: Plan, pool_ids: list[str], name_of: Mapping[str, str], bucket_bytes: int
    ) -> _Failure | None:
        failed = move_objects(
            self.comm,
            plan,
            self.pool,
            pool_ids=pool_ids,
            bucket_bytes=bucket_bytes,
            stats=self.stream,
            timeout=self.timeout,
        )
        if failed is None:
            return None
        sha = plan.objects[failed[0]]
        return self.failure("move", name_of.get(sha, sha), failed[1])

    # -- publish -------------------------------------------------------------------

    def finish(self, plan: Plan, artifacts: int, failure: _Failure | None) -> PrefetchReport:
        """Collective: combine every rank's figures into one report (the final barrier)."""
        mine = {
            "downloads": self.downloads,
            "origin_bytes": self.origin_bytes,
            "broadcasts": self.stream.broadcasts,
            "broadcast_bytes": self.stream.bytes_sent,
            "received_bytes": self.stream.received_bytes,
            "discarded_bytes": self.stream.discarded_bytes,
            # Every download is published into this rank's pool.
            "published": self.downloads + self.stream.published,
            "peak": self.stream.peak_bytes,
            "seconds": dict(self.seconds),
        }
        gathered: list[tuple[dict[str, Any], _Failure | None]] = self.comm.allgather_object(
            (mine, failure), timeout=self.timeout
        )
        self.raise_first(f for _, f in gathered)
        figures = [g for g, _ in gathered]
        report = PrefetchReport(
            operation=self.operation,
            artifacts=artifacts,
            objects=len(plan.objects),
            downloads=sum(f["downloads"] for f in figures),
            origin_bytes=sum(f["origin_bytes"] for f in figures),
            broadcasts=sum(f["broadcasts"] for f in figures),
            broadcast_bytes=sum(f["broadcast_bytes"] for f in figures),
            received_bytes=sum(f["received_bytes"] for f in figures),
            discarded_bytes=sum(f["discarded_bytes"] for f in figures),
            pool_hits=plan.hits,
            objects_published=sum(f["published"] for f in figures),
            pools=len(plan.pools),
            writers=plan.writer_ranks,
            downloaders=tuple(r for r, f in enumerate(figures) if f["downloads"]),
            peak_bytes=max(f["peak"] for f in figures),
            seconds={p: max(f["seconds"][p] for f in figures) for p in PHASES},
        )
        log.info("%s", report.summary())
        return report


def _agreed_list(artifacts: Iterable[Artifact]) -> list[Artifact]:
    """Sorted by (name, sha), one entry per pair, a known size kept."""
    unique: dict[tuple[str, str], Artifact] = {}
    for a in artifacts:
        key = (a.name, a.sha256)
        if key not in unique or unique[key].size is None:
            unique[key] = a
    return [unique[k] for k in sorted(unique)]


def _mismatch(digests: list[tuple[str, int]]) -> ManifestMismatchError:
    groups: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    for rank, (digest, count) in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
        counts[digest] = count
    parts = "; ".join(
        f"ranks {ranks} have {digest[:12]} ({counts[digest]} artifacts)"
        for digest, ranks in groups.items()
    )
    return ManifestMismatchError(
        f"ranks called prefetch with different artifact lists: {parts}; "
        "every rank must pass the same list",
        groups=groups,
    )


def prefetch(
    artifacts: Iterable[Artifact],
    *,
    comm: Communicator,
    pool: _Pool,
    origin: _Origin,
    timeout: float | None = None,
    bucket_bytes: int | None = None,
    downloads_per_rank: int | None = None,
) -> PrefetchReport:
    """Collective: make every rank's pool hold every artifact, fetching each missing
    one from ``origin`` exactly once per job.

    Call on every rank of ``comm`` with the same ``artifacts`` (order and duplicates
    do not matter). ``timeout`` bounds every wait (default ``DISTCACHE_TIMEOUT``);
    ``bucket_bytes`` is the size of one broadcast (``DISTCACHE_BUCKET_BYTES``);
    ``downloads_per_rank`` the download threads per rank
    (``DISTCACHE_DOWNLOADS_PER_RANK``).

    Raises:
        ManifestMismatchError: ranks passed different lists (on every rank).
        ManifestError: one name is listed with two digests (on every rank).
        PrefetchError: a download, read, verification or publication failed on some
            rank, or a peer did not arrive in time (the same error on every rank).
        ConfigError: a bad setting.
    """
    conf = settings(
        timeout=timeout, bucket_bytes=bucket_bytes, downloads_per_rank=downloads_per_rank
    )
    run = _Run("prefetch", comm, pool, conf.timeout)

    def body() -> PrefetchReport:
        with run.phase("agree"):
            listing = _agreed_list(artifacts)
            digest = hashlib.sha256(manifest_text(listing).encode()).hexdigest()
            infos = comm.allgather_object(
                (digest, len(listing), pool.pool_id, comm.node_id), timeout=run.timeout
            )
            if len({i[0] for i in infos}) > 1:
                raise _mismatch([(i[0], i[1]) for i in infos])
            artifact_of: dict[str, Artifact] = {}
            for a in listing:
                artifact_of.setdefault(a.sha256, a)
            names = [a.name for a in listing]
            dup = next((n for n, m in itertools.pairwise(names) if n == m), None)
            if dup is not None:
                raise ManifestError(f"{dup} is listed with two digests", line=0, text=dup)
            pool_ids = [i[2] for i in infos]
            node_ids = [i[3] for i in infos]
            objects = sorted(artifact_of)
        with run.phase("discover"):
            have = _discover(run, objects, pool_ids)
        with run.phase("plan"):
            plan = make_plan(
                objects, [artifact_of[s].size for s in objects], pool_ids, node_ids, have
            )
        with run.phase("fetch"):
            mine = plan.downloads.get(comm.rank, ())
            todo = [artifact_of[plan.objects[i]] for i in mine]
            failure = run.download(todo, origin, conf.downloads_per_rank) if todo else None
            if plan.downloads:
                run.check(failure)
        with run.phase("move"):
            if plan.sends:
                name_of = {sha: a.name for sha, a in artifact_of.items()}
                run.check(run.move(plan, pool_ids, name_of, conf.bucket_bytes))
        with run.phase("publish"):
            failure = None
            if plan.writers[pool_ids[comm.rank]] == comm.rank:
                try:
                    pool.remember(listing)
                except Exception as exc:
                    failure = run.failure("publish", None, exc)
        return run.finish(plan, len(listing), failure)

    return run.guarded(body)


def _discover(run: _Run, objects: list[str], pool_ids: list[str]) -> dict[str, list[bool]]:
    """Collective: every pool's writer reports which ``objects`` its pool holds."""
    writers = elect_writers(pool_ids)
    payload: bytes | None = None
    failure: _Failure | None = None
    if writers[pool_ids[run.comm.rank]] == run.comm.rank:
        try:
            payload = encode_bitmap([run.pool.has(s) for s in objects])
        except Exception as exc:
            failure = run.failure("discover", None, exc)
    gathered = run.comm.allgather_object((payload, failure), timeout=run.timeout)
    run.raise_first(f for _, f in gathered)
    return {p: decode_bitmap(gathered[w][0], len(objects)) for p, w in writers.items()}


def sync(
    *,
    comm: Communicator,
    pool: _Pool,
    timeout: float | None = None,
    state: SyncState | None = None,
    bucket_bytes: int | None = None,
) -> PrefetchReport:
    """Collective, at a safe point: every object any rank's pool gained since the last
    sync (its journal past ``state``'s cursor; the whole journal without ``state``)
    reaches every other pool, with its names. The origin is never contacted.

    ``state`` is updated in place when the sync succeeds.

    Raises:
        PrefetchError: a read, verification or publication failed on some rank, or a
            peer did not arrive in time (the same error on every rank).
        ConfigError: a bad setting.
    """
    conf = settings(timeout=timeout, bucket_bytes=bucket_bytes)
    run = _Run("sync", comm, pool, conf.timeout)

    def body() -> PrefetchReport:
        with run.phase("agree"):
            infos = comm.allgather_object((pool.pool_id, comm.node_id), timeout=run.timeout)
            pool_ids = [i[0] for i in infos]
            node_ids = [i[1] for i in infos]
            is_writer = elect_writers(pool_ids)[pool_ids[comm.rank]] == comm.rank
        with run.phase("discover"):
            gained: tuple[list[str], dict[str, str]] | None = None
            failure: _Failure | None = None
            cursor = 0
            if is_writer:
                try:
                    start = state.cursors.get(pool.pool_id, 0) if state is not None else 0
                    shas, cursor = pool.journal_since(start)
                    new = set(shas)
                    gained = (shas, {n: s for n, s in pool.names().items() if s in new})
                except Exception as exc:
                    failure = run.failure("discover", None, exc)
            reports = comm.allgather_object((gained, failure), timeout=run.timeout)
            run.raise_first(f for _, f in reports)
            objects = sorted({s for g, _ in reports if g is not None for s in g[0]})
            labels: dict[str, str] = {}
            for g, _ in reports:  # rank order: the lowest writer's label wins a conflict
                for name, sha in (g[1] if g is not None else {}).items():
                    labels.setdefault(name, sha)
            have = _discover(run, objects, pool_ids)
        with run.phase("plan"):
            plan = make_plan(
                objects, [None] * len(objects), pool_ids, node_ids, have, allow_downloads=False
            )
            if plan.lost:
                log.warning(
                    "sync: %d object(s) listed in a journal are in no pool any more", len(plan.lost)
                )
        name_of = {sha: name for name, sha in sorted(labels.items(), reverse=True)}
        with run.phase("move"):
            if plan.sends:
                run.check(run.move(plan, pool_ids, name_of, conf.bucket_bytes))
        with run.phase("publish"):
            failure = None
            if is_writer:
                try:
                    present = set(objects) - {objects[i] for i in plan.lost}
                    pool.remember(
                        [Artifact(n, s) for n, s in sorted(labels.items()) if s in present]
                    )
                except Exception as exc:
                    failure = run.failure("publish", None, exc)
        report = run.finish(plan, len(objects), failure)
        if is_writer and state is not None:
            state.cursors[pool.pool_id] = cursor
        return report

    return run.guarded(body)
