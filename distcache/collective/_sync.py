"""The collective sync: at a safe point, whatever any rank's pool gained (a lazy
download after warm-up) reaches every other pool. The origin is never contacted.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from distcache._log import get_logger
from distcache.artifact import MAX_MANIFEST_BYTES, Artifact, validate_name
from distcache.collective._arguments import checked
from distcache.collective._cursors import (
    held_cursor,
    journal_matches,
    journal_past_received,
    journal_path,
    labels_past_received,
    labels_since,
    pools_key,
    store_cursor,
    store_labels_cursor,
)
from distcache.collective._plan import elect_writers, make_plan
from distcache.collective._report import PrefetchReport
from distcache.collective._run import Failure, Run, discover, own_settings
from distcache.collective._sharing import agree_pools
from distcache.collective._totals import finish
from distcache.collective._trust import Trust, draw, next_token, pack, trusted, unpack
from distcache.comm import Communicator, node_tree
from distcache.errors import WireError
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
    another set starts from the cursors its pools keep for that set instead. ``token``
    is the one that sync drew (:mod:`distcache.collective._trust`): its cursors are
    resumed from only where the pool still holds it."""

    cursors: dict[str, int] = field(default_factory=dict)
    marks: dict[str, str] = field(default_factory=dict)
    labels: dict[str, tuple[int, str]] = field(default_factory=dict)
    key: str | None = None
    token: str | None = None


#: What a rank sends in a sync's exchange: ``(gained, named, whole, failure)``; a
#: writer's ``gained`` opens with its :data:`~distcache.collective._trust.Trust`.
Report = tuple[bytes | None, bytes | None, tuple[bool, bool], Failure | None]


@dataclass
class _Part:
    """What a writer sends of its pool's logs (nothing, from another rank), and where
    it read them up to."""

    gained: bytes | None = None
    named: bytes | None = None
    whole: tuple[bool, bool] = (True, True)  # whether each part was sent whole
    failure: Failure | None = None
    trust: Trust | None = None
    cursor: int = 0
    mark: str | None = None
    labelled: tuple[int, str] | None = None  # the names.log cursor reached

    @property
    def report(self) -> Report:
        gained = None if self.gained is None or self.trust is None else (
            pack(self.trust) + self.gained)
        return gained, self.named, self.whole, self.failure


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
    """A rank's :data:`Report` as sent, its shape checked.

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


def _keep_part(pool: Pool, part: _Part, key: str, token: str | None,
               state: SyncState | None) -> None:
    """Keep where a successful sync left this writer's pool, with the sync's ``token``,
    in the pool and in ``state``. A cursor not kept (logged) costs the next sync more
    bytes, never an object: the sync has already succeeded on every rank."""
    if part.mark is not None:  # a cursor is kept only with its check on the journal
        store_cursor(pool, part.cursor, part.mark, key, token)
    if part.labelled is not None:
        store_labels_cursor(pool, *part.labelled, key, token)
    if state is not None:
        state.key, state.token = key, token
        state.cursors[pool.pool_id] = part.cursor
        if part.mark is not None:
            state.marks[pool.pool_id] = part.mark
        else:
            state.marks.pop(pool.pool_id, None)
        if part.labelled is not None:
            state.labels[pool.pool_id] = part.labelled


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
    """The inverse of :func:`encode_gained` (and of :func:`encode_labels`), each
    label's name checked as a pool checks it before recording it.

    Raises:
        ValueError: the blob is malformed, or names a label no pool may record
            (:class:`~distcache.errors.ArtifactNameError`).
    """
    if not isinstance(blob, bytes):
        raise ValueError(f"journal exchange of type {type(blob).__name__}")
    try:
        (count,) = struct.unpack_from("<I", blob)
        end = 4 + 32 * count
        if len(blob) < end:
            raise ValueError(f"journal digest list is cut short ({len(blob)} < {end} bytes)")
        # Labels are a manifest's worth at most: a few kilobytes from a peer must not
        # inflate to gigabytes here (zlib packs about 1,000 to 1).
        inflate = zlib.decompressobj()
        text = inflate.decompress(blob[end:], MAX_MANIFEST_BYTES).decode("utf-8")
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError(f"journal labels are cut short or exceed {MAX_MANIFEST_BYTES} "
                             "bytes")
    except (struct.error, zlib.error) as exc:
        raise ValueError(f"journal exchange is malformed: {exc}") from exc
    shas = [blob[4 + 32 * i : 4 + 32 * (i + 1)].hex() for i in range(count)]
    names: dict[str, str] = {}
    for line in text.split("\n") if text else ():
        index, _, name = line.partition(" ")
        if not (index.isascii() and index.isdigit() and name) or int(index) >= count:
            raise ValueError(f"journal exchange has a malformed label {line[:80]!r}")
        names[validate_name(name)] = shas[int(index)]  # else no pool could record it
    return shas, names


def _read_part(run: Run, pool: Pool, key: str, state: SyncState | None, *,
               whole: bool = False) -> _Part:
    """What this writer sends: its pool's journal and labels since the cursors it
    keeps for ``key`` (or ``state``'s, where further and taken with the token the pool
    holds); with ``whole``, all of them, as a first sync over the set sends. A failure
    is the part's, for the exchange."""
    part = _Part()
    try:
        start, held, from_state, session = 0, None, False, None
        if not whole:
            if state is not None and state.key not in (None, key):
                state.cursors, state.marks, state.labels, state.token = {}, {}, {}, None
            start, held = held_cursor(pool, key)
            if journal_path(pool) is None:  # a pool without files: the session's word
                held = None if state is None else state.token
            if state is not None and state.token == held:
                session = state.labels.get(pool.pool_id)
                # Whether the journal part is news: only where no names.log says it
                # (a pool without files), from a session's cursor.
                if pool.pool_id in state.cursors:
                    at = state.cursors[pool.pool_id]
                    if journal_matches(pool, at, state.marks.get(pool.pool_id)):
                        start, from_state = max(start, at), True
        shas, part.cursor = pool.journal_since(start)
        journal = journal_path(pool)
        part.mark = None if journal is None else journal_mark(journal, part.cursor)
        new = set(shas)
        own = {n: s for n, s in pool.names().items() if s in new}
        part.gained = encode_gained(shas, own)
        part.whole = (not from_state, True)
        since = labels_since(pool, key, session, whole=whole, token=held)
        resumed = start > 0
        if since is not None:
            recorded, reached, reached_mark, labels_held = since
            part.labelled = (reached, reached_mark)
            resumed = resumed or labels_held
            # Where the pool keeps names.log, its cursor alone says what is news: the
            # journal part's labels are the current ones of the objects it lists,
            # recorded whenever. What the journal part names already, as news or not
            # alike, is not sent twice.
            part.whole = (True, not labels_held)
            extra = {n: s for n, s in recorded.items() if labels_held or own.get(n) != s}
            part.named = encode_labels(extra) if extra else None
        part.trust = (held, resumed and not whole, draw() if run.comm.rank == 0 else None)
    except Exception as exc:
        part.failure = run.failure("discover", None, exc)
    return part


def _exchange(run: Run, node_ids: list[str], report: Report
              ) -> tuple[list[tuple[list[str], dict[str, str], bool]], list[Trust | None]]:
    """Collective: every rank's report, decoded, in rank order, with each rank's trust.

    Every rank holds the same reports: one error, the lowest rank's, whether a report
    is of another shape, says that it failed, or holds a bad blob.

    Raises:
        PrefetchError: a rank failed or sent a malformed report (on every rank alike).
    """
    reports = run.comm.allgather_object(report, timeout=run.timeout)
    checked = [_checked(sender, node_ids[sender], sent) for sender, sent in enumerate(reports)]
    run.raise_first(failed for *_, failed in checked)  # the shared rule: primary()
    decoded = []
    trusts: list[Trust | None] = []
    for sender, (gained, named, parts, _) in enumerate(checked):
        trust = None
        try:
            if isinstance(gained, bytes):
                trust, gained = unpack(gained)
            for blob, sent_whole in zip((gained, named), parts, strict=True):
                if blob is not None:
                    decoded.append((*decode_gained(blob), sent_whole))
        except ValueError as exc:
            run.raise_first([("discover", None, sender, node_ids[sender],
                              f"{type(exc).__name__}: {exc}")])
        trusts.append(trust)
    return decoded, trusts


def _infos(gathered: list[Any]) -> list[tuple[str, str]]:
    """Each rank's ``(pool id, node id)`` as it sent it, checked for its shape.

    Raises:
        WireError: a rank sent something else (naming it): every rank received the
            same, so every rank raises it alike.
    """
    infos: list[tuple[str, str]] = []
    for rank, info in enumerate(gathered):
        if not (type(info) is tuple and len(info) == 2
                and type(info[0]) is str and type(info[1]) is str):
            raise WireError(f"sync: rank {rank} sent a malformed (pool id, node id) "
                            f"pair {info!r:.120}", op="sync", peer=rank,
                            agreed=True)  # every rank received the same
        infos.append((info[0], info[1]))
    return infos


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
        ConfigError: a bad setting, or an argument of the wrong kind.
    """
    checked("sync", comm, pool, state=state, state_type=SyncState)
    conf = own_settings(comm, timeout=timeout, bucket_bytes=bucket_bytes)
    run = Run("sync", comm, pool, conf.timeout)

    def body() -> PrefetchReport:
        with run.phase("agree"):
            # Every all-gather of the collective goes through node leaders from here.
            run.comm = comm = node_tree(run.comm, timeout=run.timeout)
            infos = _infos(comm.allgather_object((pool.pool_id, comm.node_id),
                                                 timeout=run.timeout))
            node_ids = [i[1] for i in infos]
            pool_ids = agree_pools(run, [i[0] for i in infos], node_ids)
            is_writer = elect_writers(pool_ids)[pool_ids[comm.rank]] == comm.rank
        with run.phase("discover"):
            key = pools_key(pool_ids)
            part = _read_part(run, pool, key, state) if is_writer else _Part()
            decoded, trusts = _exchange(run, node_ids, part.report)
            if not trusted(trusts):
                # Some pool of the set missed the sync the cursors were kept by (a copy,
                # a restored backup): what was sent since them is not all it lacks.
                resumed = is_writer and part.trust is not None and part.trust[1]
                again = _read_part(run, pool, key, None, whole=True) if resumed else _Part()
                decoded += _exchange(run, node_ids, again.report)[0]
            token = next_token(trusts)
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
        # What the sync brings is its set, found in this pool or moved in: a capped
        # pool's collection when the batch ends keeps it.
        found = have[pool_ids[comm.rank]]
        with run.durable(), run.phase("move"):
            pool.hold([s for s, held in zip(objects, found, strict=True) if held])
            if plan.sends:
                run.check(run.move(plan, pool_ids, name_of, conf.bucket_bytes))
            pool.hold([s for s, held in zip(objects, found, strict=True) if not held])
        with run.phase("publish"):
            failure = None
            if is_writer:
                try:
                    pool.remember([Artifact(n, s) for n, s in sorted(labels.items())])
                except Exception as exc:
                    failure = run.failure("publish", None, exc)
            if is_writer and failure is None:
                part.cursor, part.mark = journal_past_received(
                    pool, part.cursor, part.mark, present)
                if part.labelled is not None:
                    part.labelled = labels_past_received(pool, *part.labelled, labels)
        report = finish(run, plan, len(objects), failure)
        if is_writer:
            _keep_part(pool, part, key, token, state)
        return report

    return run.guarded(body)
