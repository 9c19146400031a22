"""The collective sync: at a safe point, whatever any rank's pool gained (a lazy
download after warm-up) reaches every other pool. The origin is never contacted.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
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

log = get_logger(__name__)


@dataclass
class SyncState:
    """Where the previous :func:`sync` left each pool's journal (owned by the caller,
    e.g. a session). The pool keeps the same cursor itself (``sync.cursor``, see
    :mod:`distcache.store.layout`), so a sync without a state, or a session's first,
    starts where the last sync over that pool ended."""

    cursors: dict[str, int] = field(default_factory=dict)


def stored_cursor(pool: Pool) -> int:
    """The journal offset the last sync over ``pool`` reached (0: none, or a pool that
    keeps no files)."""
    path = _cursor_path(pool)
    if path is None:
        return 0
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return 0
    return int(text) if text.isdigit() else 0


def store_cursor(pool: Pool, cursor: int) -> None:
    """Keep ``cursor`` in ``pool`` (atomically; a failure is logged: the next sync then
    sends more than it must, and nothing is lost)."""
    path = _cursor_path(pool)
    if path is None:
        return
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        temp.write_text(f"{cursor}\n", encoding="ascii")
        os.replace(temp, path)
    except OSError as exc:
        log.warning("sync: cannot keep the journal cursor in %s: %s", path, exc)
        with contextlib.suppress(OSError):
            temp.unlink()


def _cursor_path(pool: Pool) -> Path | None:
    layout = getattr(pool, "layout", None)
    path = getattr(layout, "sync_cursor", None)
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
    (count,) = struct.unpack_from("<I", blob)
    end = 4 + 32 * count
    if len(blob) < end:
        raise ValueError(f"journal digest list is cut short ({len(blob)} < {end} bytes)")
    shas = [blob[4 + 32 * i : 4 + 32 * (i + 1)].hex() for i in range(count)]
    text = zlib.decompress(blob[end:]).decode("utf-8")
    names: dict[str, str] = {}
    for line in text.split("\n") if text else ():
        index, name = line.split(" ", 1)
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
    sync over it (its journal past the cursor the pool keeps, or ``state``'s when that
    is further; the whole journal of a pool never synced) reaches every other pool,
    with its names. The origin is never contacted. Each pool's writer sends what its
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
            cursor = 0
            if is_writer:
                try:
                    start = max(stored_cursor(pool), state.cursors.get(pool.pool_id, 0)
                                if state is not None else 0)
                    shas, cursor = pool.journal_since(start)
                    new = set(shas)
                    gained = encode_gained(
                        shas, {n: s for n, s in pool.names().items() if s in new})
                except Exception as exc:
                    failure = run.failure("discover", None, exc)
            reports = comm.allgather_object((gained, failure), timeout=run.timeout)
            run.raise_first(f for _, f in reports)
            decoded = [decode_gained(g) for g, _ in reports if g is not None]
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
            if is_writer:
                try:
                    present = set(objects) - {objects[i] for i in plan.lost}
                    pool.remember(
                        [Artifact(n, s) for n, s in sorted(labels.items()) if s in present]
                    )
                except Exception as exc:
                    failure = run.failure("publish", None, exc)
        report = finish(run, plan, len(objects), failure)
        if is_writer:
            store_cursor(pool, cursor)
            if state is not None:
                state.cursors[pool.pool_id] = cursor
        return report

    return run.guarded(body)
