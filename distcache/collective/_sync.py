"""The collective sync: at a safe point, whatever any rank's pool gained (a lazy
download after warm-up) reaches every other pool. The origin is never contacted.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.collective._cursors import (
    journal_matches,
    journal_past_received,
    journal_path,
    labels_past_received,
    labels_since,
    pools_key,
    store_cursor,
    store_labels_cursor,
    stored_cursor,
)
from distcache.collective._plan import elect_writers, make_plan
from distcache.collective._report import PrefetchReport
from distcache.collective._run import Failure, Run, discover, own_settings
from distcache.collective._sharing import agree_pools
from distcache.collective._totals import finish
from distcache.comm import Communicator, node_tree
from distcache.store import Pool
from distcache.store._log import journal_mark

log = get_logger(__name__)


@dataclass
class SyncState:
    """Where the previous :func:`sync` left each pool's journal and labels (owned by
    the caller, e.g. a session). The pool keeps the same cursors itself
    (``sync.cursor`` and ``sync.names.cursor``, see :mod:`distcache.store.layout`), so
    a sync without a state, or a session's first, starts where the last sync over that
    pool ended. ``marks`` holds each journal cursor's check on the journal
    (:func:`~distcache.store._log.journal_mark`): a cursor whose journal no longer holds
    the bytes it was taken after is not resumed from. ``labels`` holds each pool's
    ``names.log`` offset with its mark (:func:`~distcache.store._log.names_since`).
    ``key`` names the set of pools they were taken over (:func:`pools_key`): a sync over
    another set starts from the cursors its pools keep for that set instead."""

    cursors: dict[str, int] = field(default_factory=dict)
    marks: dict[str, str] = field(default_factory=dict)
    labels: dict[str, tuple[int, str]] = field(default_factory=dict)
    key: str | None = None


def encode_gained(shas: list[str], names: dict[str, str]) -> bytes:
    """What a writer's journal gained, compactly: the digests as raw 32-byte values
    and the labels as ``<index into them> <name>`` lines, zlib-compressed (a whole
    journal of a kernel family is a few hundred kilobytes, not megabytes of pickled
    hex strings)."""
    position = {sha: i for i, sha in enumerate(shas)}
    text = "\n".join(f"{position[sha]} {name}" for name, sha in sorted(names.items())
                     if sha in position)
    digests = b"".join(bytes.fromhex(sha) for sha in shas)
    return struct.pack("<I", len(shas)) + digests + zlib.compress(text.encode("utf-8"))


def encode_labels(labels: dict[str, str]) -> bytes:
    """Labels recorded in a writer's ``names.log`` since its cursor, for bytes the
    journal part does not list: :func:`encode_gained` of their digests."""
    return encode_gained(sorted(set(labels.values())), labels)


def _report_parts(report: object) -> tuple[object, object, tuple[bool, bool], object]:
    """A writer's ``(gained, named, whole, failure)`` as sent, its shape checked.

    Raises:
        ValueError: it is not of that shape (a peer of another version, or damage).
    """
    if isinstance(report, tuple | list) and len(report) == 4:
        gained, named, whole, failure = report
        if isinstance(whole, tuple | list) and len(whole) == 2 and all(
                isinstance(w, bool) for w in whole) and _is_failure(failure):
            return gained, named, (whole[0], whole[1]), failure
    size = len(report) if isinstance(report, tuple | list) else None
    raise ValueError(f"sync report is not (gained, named, whole, failure): a "
                     f"{type(report).__name__}" + ("" if size is None else f" of {size}"))


def _checked(sender: int, host: str, report: object
             ) -> tuple[object, object, tuple[bool, bool], Failure | None]:
    """``sender``'s report as :func:`_report_parts` reads it; one of another shape is
    a failure of ``sender``'s, reported as any other."""
    try:
        return _report_parts(report)  # type: ignore[return-value]
    except ValueError as exc:
        return None, None, (True, True), ("discover", None, sender, host,
                                          f"{type(exc).__name__}: {exc}")


def _is_failure(value: object) -> bool:
    """Whether ``value`` is None or a :data:`~distcache.collective._run.Failure`."""
    if value is None:
        return True
    if not isinstance(value, tuple | list) or len(value) != 5:
        return False
    phase, artifact, rank, host, cause = value
    return (isinstance(phase, str) and (artifact is None or isinstance(artifact, str))
            and isinstance(rank, int) and isinstance(host, str) and isinstance(cause, str))


def _winners(decoded: list[tuple[list[str], dict[str, str], bool]],
             present: set[str]) -> dict[str, str]:
    """The label each name ends with in every pool: of the labels whose bytes are
    ``present``, one recorded since a held cursor (news) wins over one from a part sent
    whole (a pool never synced over these pools, or whose log was rewritten), so an old
    label never reverts a new one; within a kind the lowest writer's wins."""
    fresh: dict[str, str] = {}
    old: dict[str, str] = {}
    for _, names, sent_whole in decoded:  # in rank order
        for name, sha in names.items():
            if sha in present:
                (old if sent_whole else fresh).setdefault(name, sha)
    return {**old, **fresh}


def decode_gained(blob: object) -> tuple[list[str], dict[str, str]]:
    """The inverse of :func:`encode_gained` (and of :func:`encode_labels`).

    Raises:
        ValueError: the blob is malformed.
    """
    if not isinstance(blob, bytes):
        raise ValueError(f"journal exchange of type {type(blob).__name__}")
    try:
        (count,) = struct.unpack_from("<I", blob)
        end = 4 + 32 * count
        if len(blob) < end:
            raise ValueError(f"journal digest list is cut short ({len(blob)} < {end} bytes)")
        text = zlib.decompress(blob[end:]).decode("utf-8")
    except (struct.error, zlib.error) as exc:
        raise ValueError(f"journal exchange is malformed: {exc}") from exc
    shas = [blob[4 + 32 * i : 4 + 32 * (i + 1)].hex() for i in range(count)]
    names: dict[str, str] = {}
    for line in text.split("\n") if text else ():
        index, _, name = line.partition(" ")
        if not (index.isascii() and index.isdigit() and name) or int(index) >= count:
            raise ValueError(f"journal exchange has a malformed label {line[:80]!r}")
        names[name] = shas[int(index)]
    return shas, names


def sync(
    *,
    comm: Communicator,
    pool: Pool,
    timeout: float | None = None,
    state: SyncState | None = None,
    bucket_bytes: int | None = None,
) -> PrefetchReport:
    """Collective, at a safe point: every object any rank's pool gained since the last
    sync over it (its journal past the cursor the pool keeps for a sync over the same
    pools, or ``state``'s when that is further; the whole journal of a pool never
    synced over them) reaches every other pool, with its names. So does every label
    recorded since (its ``names.log`` past a cursor kept alike, the whole log when it
    was rewritten), with its bytes where a pool lacks them. The origin is never
    contacted. Each pool's writer sends what its journal and its labels gained; through
    node leaders (:func:`distcache.comm.node_tree`) a rank receives one such list per
    node, not per rank.

    ``state`` is updated in place when the sync succeeds.

    Raises:
        PrefetchError: a read, verification or publication failed on some rank, or a
            peer did not arrive in time (the same error on every rank).
        ConfigError: a bad setting.
    """
    conf = own_settings(comm, timeout=timeout, bucket_bytes=bucket_bytes)
    run = Run("sync", comm, pool, conf.timeout)

    def body() -> PrefetchReport:
        with run.phase("agree"):
            # Every all-gather of the collective goes through node leaders from here.
            run.comm = comm = node_tree(run.comm, timeout=run.timeout)
            infos = comm.allgather_object((pool.pool_id, comm.node_id), timeout=run.timeout)
            node_ids = [i[1] for i in infos]
            pool_ids = agree_pools(run, [i[0] for i in infos], node_ids)
            is_writer = elect_writers(pool_ids)[pool_ids[comm.rank]] == comm.rank
        with run.phase("discover"):
            gained: bytes | None = None
            named: bytes | None = None
            whole = (True, True)  # whether each part was sent whole (no cursor held)
            failure: Failure | None = None
            cursor, mark, key = 0, None, "-"
            labelled: tuple[int, str] | None = None  # the names.log cursor reached
            if is_writer:
                try:
                    key = pools_key(pool_ids)
                    if state is not None and state.key not in (None, key):
                        state.cursors, state.marks, state.labels = {}, {}, {}
                    # Whether the journal part is news: only where no names.log says it
                    # (a pool without files), from a session's cursor.
                    start, resumed = stored_cursor(pool, key), False
                    if state is not None and pool.pool_id in state.cursors:
                        at = state.cursors[pool.pool_id]
                        if journal_matches(pool, at, state.marks.get(pool.pool_id)):
                            start, resumed = max(start, at), True
                    shas, cursor = pool.journal_since(start)
                    journal = journal_path(pool)
                    mark = None if journal is None else journal_mark(journal, cursor)
                    new = set(shas)
                    own = {n: s for n, s in pool.names().items() if s in new}
                    gained = encode_gained(shas, own)
                    whole = (not resumed, True)
                    since = labels_since(
                        pool, key, None if state is None else state.labels.get(pool.pool_id))
                    if since is not None:
                        recorded, reached, reached_mark, held = since
                        labelled = (reached, reached_mark)
                        # Where the pool keeps names.log, its cursor alone says what is
                        # news: the journal part's labels are the current ones of the
                        # objects it lists, recorded whenever. What the journal part
                        # names already, as news or not alike, is not sent twice.
                        whole = (True, not held)
                        extra = {n: s for n, s in recorded.items() if held or own.get(n) != s}
                        named = encode_labels(extra) if extra else None
                except Exception as exc:
                    failure = run.failure("discover", None, exc)
            reports = comm.allgather_object((gained, named, whole, failure),
                                            timeout=run.timeout)
            # Every rank holds the same reports: one error, the lowest rank's, whether a
            # report is of another shape, says that it failed, or holds a bad blob.
            decoded = []
            checked = [_checked(sender, node_ids[sender], report)
                       for sender, report in enumerate(reports)]
            run.raise_first(failed for *_, failed in checked)  # the shared rule: primary()
            for sender, (*blobs, parts, _) in enumerate(checked):
                try:
                    for blob, sent_whole in zip(blobs, parts, strict=True):
                        if blob is not None:
                            decoded.append((*decode_gained(blob), sent_whole))
                except ValueError as exc:
                    run.raise_first([("discover", None, sender, node_ids[sender],
                                      f"{type(exc).__name__}: {exc}")])
            objects = sorted({s for shas, _, _ in decoded for s in shas})
            have = discover(run, objects, pool_ids)
        with run.phase("plan"):
            plan = make_plan(
                objects, [None] * len(objects), pool_ids, node_ids, have, allow_downloads=False
            )
            if plan.lost:
                log.warning(
                    "sync: %d object(s) listed in a journal or a label are in no pool any more",
                    len(plan.lost),
                )
        present = set(objects) - {objects[i] for i in plan.lost}
        labels = _winners(decoded, present)
        name_of = {sha: name for name, sha in sorted(labels.items(), reverse=True)}
        # A serving loop's safe point does not wait on the flush (see Run.durable).
        with run.durable(), run.phase("move"):
            if plan.sends:
                run.check(run.move(plan, pool_ids, name_of, conf.bucket_bytes))
        with run.phase("publish"):
            failure = None
            if is_writer:
                try:
                    pool.remember([Artifact(n, s) for n, s in sorted(labels.items())])
                except Exception as exc:
                    failure = run.failure("publish", None, exc)
            if is_writer and failure is None:
                cursor, mark = journal_past_received(pool, cursor, mark, present)
                if labelled is not None:
                    labelled = labels_past_received(pool, *labelled, labels)
        report = finish(run, plan, len(objects), failure)
        if is_writer:
            if mark is not None:  # a cursor is kept only with its check on the journal
                store_cursor(pool, cursor, mark, key)
            if state is not None:
                state.key = key
                state.cursors[pool.pool_id] = cursor
                if mark is not None:
                    state.marks[pool.pool_id] = mark
                else:
                    state.marks.pop(pool.pool_id, None)
            if labelled is not None:
                store_labels_cursor(pool, *labelled, key)
                if state is not None:
                    state.labels[pool.pool_id] = labelled
        return report

    return run.guarded(body)
