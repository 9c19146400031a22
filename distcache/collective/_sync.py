"""The collective sync: at a safe point, whatever any rank's pool gained (a lazy
download after warm-up) reaches every other pool. The origin is never contacted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.collective._plan import elect_writers, make_plan
from distcache.collective._report import PrefetchReport
from distcache.collective._run import Failure, Run, discover
from distcache.collective._sharing import agree_pools
from distcache.collective._totals import finish
from distcache.comm import Communicator, node_tree
from distcache.config import settings
from distcache.store import Pool
from distcache.store._fs import CREATE_FLAGS, READ_FLAGS, is_hex, process_umask, write_all
from distcache.store._log import journal_mark

log = get_logger(__name__)


@dataclass
class SyncState:
    """Where the previous :func:`sync` left each pool's journal (owned by the caller,
    e.g. a session). The pool keeps the same cursor itself (``sync.cursor``, see
    :mod:`distcache.store.layout`), so a sync without a state, or a session's first,
    starts where the last sync over that pool ended. ``marks`` holds each cursor's
    check on the journal (:func:`~distcache.store._log.journal_mark`): a cursor whose
    journal no longer holds the bytes it was taken after is not resumed from."""

    cursors: dict[str, int] = field(default_factory=dict)
    marks: dict[str, str] = field(default_factory=dict)


#: The most a cursor file is read of, and the most cursors it keeps (the latest).
_CURSOR_BYTES = 4096
_MAX_CURSORS = 32


def pools_key(pool_ids: list[str]) -> str:
    """The key of the cursor a sync over ``pool_ids`` keeps: what one job's sync sent
    says nothing of what a sync over other pools (another job sharing a pool) did."""
    joined = "\n".join(sorted(set(pool_ids)))
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()[:16]


def stored_cursor(pool: Pool, key: str = "-") -> int:
    """The journal offset the last sync over ``pool`` with ``key`` (:func:`pools_key`)
    reached (0: none, a pool that keeps no files, or a cursor whose mark the journal no
    longer matches). The file is opened as the pool opens every file: never through a
    link, never blocking; one that is not a regular file holds no cursor."""
    path = _cursor_path(pool)
    if path is None:
        return 0
    cursor, mark = _read_cursors(path).get(key, (0, None))
    return cursor if mark is not None and _matches(pool, cursor, mark) else 0


def store_cursor(pool: Pool, cursor: int, mark: str | None = None, key: str = "-") -> None:
    """Keep ``cursor`` for ``key`` in ``pool`` with its ``mark`` (taken now when not
    given), beside the latest cursors of other keys, written to a fresh exclusive
    temporary file and renamed into place; a failure is logged: the next sync then
    sends more than it must, and nothing is lost."""
    path = _cursor_path(pool)
    journal = _journal_path(pool)
    if path is None or journal is None:
        return
    mark = journal_mark(journal, cursor) if mark is None else mark
    if mark is None:
        log.warning("sync: the journal of %s no longer reaches %d; no cursor kept",
                    path.parent, cursor)
        return
    cursors = _read_cursors(path)
    cursors.pop(key, None)
    cursors[key] = (cursor, mark)
    text = "".join(f"{k} {c} {m}\n" for k, (c, m) in list(cursors.items())[-_MAX_CURSORS:])
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    try:
        fd = os.open(temp, CREATE_FLAGS, 0o600)
        try:
            os.fchmod(fd, 0o666 & ~process_umask())
            write_all(fd, text.encode("ascii"))
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError as exc:
        log.warning("sync: cannot keep the journal cursor in %s: %s", path, exc)
        with contextlib.suppress(OSError):
            temp.unlink()


def _read_cursors(path: Path) -> dict[str, tuple[int, str]]:
    """The well-formed ``<key> <offset> <mark>`` lines of the cursor file, oldest
    first (none when it is absent, not a regular file, or unreadable)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        text = os.read(fd, _CURSOR_BYTES).decode("ascii", "replace")
    except OSError:
        return {}
    finally:
        os.close(fd)
    cursors: dict[str, tuple[int, str]] = {}
    for line in text.split("\n"):
        parts = line.split(" ")
        if (len(parts) == 3 and parts[1].isascii() and parts[1].isdigit()
                and len(parts[1]) <= 20 and is_hex(parts[2], 8)):
            cursors.pop(parts[0], None)
            cursors[parts[0]] = (int(parts[1]), parts[2])
    return cursors


def _matches(pool: Pool, cursor: int, mark: str | None) -> bool:
    """Whether ``pool``'s journal still holds what ``cursor`` was taken after (a pool
    without files, or a cursor kept without a mark, is taken at its word)."""
    journal = _journal_path(pool)
    if journal is None or mark is None:
        return True
    return journal_mark(journal, cursor) == mark


def _past_received(pool: Pool, cursor: int, mark: str | None,
                   everywhere: set[str]) -> tuple[int, str | None]:
    """``cursor`` moved past what the journal gained during the sync when all of it
    is in ``everywhere`` (what the sync left in every pool: the objects it received),
    so the next sync does not list them again; else ``cursor`` as it was."""
    try:
        gained, end = pool.journal_since(cursor)
    except Exception:  # the journal is read again by the next sync
        return cursor, mark
    if end <= cursor or not everywhere.issuperset(gained):
        return cursor, mark
    journal = _journal_path(pool)
    if journal is None:
        return end, None
    later = journal_mark(journal, end)
    return (end, later) if later is not None else (cursor, mark)


def _cursor_path(pool: Pool) -> Path | None:
    layout = getattr(pool, "layout", None)
    path = getattr(layout, "sync_cursor", None)
    return path if isinstance(path, Path) else None


def _journal_path(pool: Pool) -> Path | None:
    layout = getattr(pool, "layout", None)
    path = getattr(layout, "journal_log", None)
    return path if isinstance(path, Path) else None


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


def decode_gained(blob: bytes) -> tuple[list[str], dict[str, str]]:
    """The inverse of :func:`encode_gained`.

    Raises:
        ValueError: the blob is malformed.
    """
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
    synced over them) reaches every other pool, with its names. The origin is never contacted. Each pool's writer sends what its
    journal gained; through node leaders (:func:`distcache.comm.node_tree`) a rank
    receives one such list per node, not per rank.

    ``state`` is updated in place when the sync succeeds.

    Raises:
        PrefetchError: a read, verification or publication failed on some rank, or a
            peer did not arrive in time (the same error on every rank).
        ConfigError: a bad setting.
    """
    conf = settings(timeout=timeout, bucket_bytes=bucket_bytes)
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
            failure: Failure | None = None
            cursor, mark, key = 0, None, "-"
            if is_writer:
                try:
                    key = pools_key(pool_ids)
                    start = stored_cursor(pool, key)
                    if state is not None:
                        held = state.cursors.get(pool.pool_id, 0)
                        if _matches(pool, held, state.marks.get(pool.pool_id)):
                            start = max(start, held)
                    shas, cursor = pool.journal_since(start)
                    journal = _journal_path(pool)
                    mark = None if journal is None else journal_mark(journal, cursor)
                    new = set(shas)
                    gained = encode_gained(
                        shas, {n: s for n, s in pool.names().items() if s in new})
                except Exception as exc:
                    failure = run.failure("discover", None, exc)
            reports = comm.allgather_object((gained, failure), timeout=run.timeout)
            run.raise_first(f for _, f in reports)
            decoded = []
            for sender, (g, _) in enumerate(reports):
                if g is None:
                    continue
                try:
                    decoded.append(decode_gained(g))
                except ValueError as exc:  # every rank holds the same blob: the same error
                    run.raise_first([("discover", None, sender, node_ids[sender],
                                      f"{type(exc).__name__}: {exc}")])
            objects = sorted({s for shas, _ in decoded for s in shas})
            labels: dict[str, str] = {}
            for _, names in decoded:  # rank order: the lowest writer's label wins a conflict
                for name, sha in names.items():
                    labels.setdefault(name, sha)
            have = discover(run, objects, pool_ids)
        with run.phase("plan"):
            plan = make_plan(
                objects, [None] * len(objects), pool_ids, node_ids, have, allow_downloads=False
            )
            if plan.lost:
                log.warning(
                    "sync: %d object(s) listed in a journal are in no pool any more", len(plan.lost)
                )
        name_of = {sha: name for name, sha in sorted(labels.items(), reverse=True)}
        # A serving loop's safe point does not wait on the flush (see Run.durable).
        with run.durable(), run.phase("move"):
            if plan.sends:
                run.check(run.move(plan, pool_ids, name_of, conf.bucket_bytes))
        with run.phase("publish"):
            failure = None
            present = set(objects) - {objects[i] for i in plan.lost}
            if is_writer:
                try:
                    pool.remember(
                        [Artifact(n, s) for n, s in sorted(labels.items()) if s in present]
                    )
                except Exception as exc:
                    failure = run.failure("publish", None, exc)
            if is_writer and failure is None:
                cursor, mark = _past_received(pool, cursor, mark, present)
        report = finish(run, plan, len(objects), failure)
        if is_writer:
            if mark is not None:  # a cursor is kept only with its check on the journal
                store_cursor(pool, cursor, mark, key)
            if state is not None:
                state.cursors[pool.pool_id] = cursor
                if mark is not None:
                    state.marks[pool.pool_id] = mark
                else:
                    state.marks.pop(pool.pool_id, None)
        return report

    return run.guarded(body)
