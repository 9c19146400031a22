"""The collective sync: at a safe point, whatever any rank's pool gained (a lazy
download after warm-up) reaches every other pool. The origin is never contacted.
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass, field

from distcache.artifact import Artifact
from distcache.collective._plan import elect_writers, make_plan
from distcache.collective._report import PrefetchReport
from distcache.collective._run import Failure, Run, discover
from distcache.collective._sharing import agree_pools
from distcache.comm import Communicator
from distcache.config import settings
from distcache.store import Pool

log = logging.getLogger(__name__)


@dataclass
class SyncState:
    """Where the previous :func:`sync` left each pool's journal (owned by the caller,
    e.g. a session). Without one, every sync compares whole journals: correct, but it
    sends every object id each time."""

    cursors: dict[str, int] = field(default_factory=dict)


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
    sync (its journal past ``state``'s cursor; the whole journal without ``state``)
    reaches every other pool, with its names. The origin is never contacted.

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
                    start = state.cursors.get(pool.pool_id, 0) if state is not None else 0
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
        report = run.finish(plan, len(objects), failure)
        if is_writer and state is not None:
            state.cursors[pool.pool_id] = cursor
        return report

    return run.guarded(body)
