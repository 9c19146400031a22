"""What the job's pools hold where nothing may be downloaded (no origin, or
``DISTCACHE_OFFLINE=1``): :func:`held_anywhere` asks each pool once, and
:func:`missing_error` is the one error, alike on every rank, for an artifact that no
pool holds; :class:`NoOrigin` stands in for the origin of a prefetch that only moves
what some pool holds. And what a prefetch leaves out of a usage record's hints: which
artifact a failed run's agreed error says the origin lacks (:func:`not_found`), and the
one warning naming them (:func:`warn_left_out`). And the checks of what the start-up
prefetch's all-gathers bring from the other ranks (:func:`sent_carries`,
:func:`sent_lists`, :func:`listed_by`): every rank receives the same, so a malformed
entry is the same :class:`~distcache.errors.WireError`, naming its sender, on every rank.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from typing import Any, BinaryIO

from distcache._log import get_logger
from distcache.artifact import MAX_MANIFEST_BYTES, Artifact, parse_checksums
from distcache.comm import Communicator
from distcache.errors import (
    ArtifactNameError,
    ArtifactNotFound,
    ConfigError,
    DistcacheError,
    ManifestError,
    OriginError,
    PoolError,
    PrefetchError,
    WireError,
)
from distcache.store import ArtifactPool

log = get_logger(__name__)

#: Names a missing-artifact error lists before "and N more".
_SHOWN_NAMES = 5
#: Names the warning about recorded artifacts left out lists before "and N more".
_SHOWN_LEFT_OUT = 20
#: The most a rank's list is inflated by at a time (:func:`listed_by`).
_INFLATE_STEP = 16 << 20


class NoOrigin:
    """The origin of a prefetch whose every artifact some pool holds: the collective
    moves what pools lack from the pools that hold it and never asks this. An object
    removed from its pool between the check and the collective's own discovery
    makes it fail here, not a request."""

    def __init__(self, offline: bool) -> None:
        self._why = "DISTCACHE_OFFLINE=1 forbids downloads" if offline else "no origin is set"

    def describe(self) -> str:
        return "no origin"

    def fetch(self, artifact: Artifact) -> bytes:
        raise OriginError(
            f"{artifact.name} left every pool during the prefetch and {self._why}; "
            "run the prefetch again", name=artifact.name)

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        return len(self.fetch(artifact))


def held_anywhere(comm: Communicator, pool: ArtifactPool, artifacts: Sequence[Artifact], *,
                  timeout: float | None = None) -> tuple[list[bool], list[str]]:
    """Collective: per artifact, whether some rank's pool holds it, and one
    ``"pool ID at ROOT on HOST (ranks ...)"`` per pool (the same on every rank). Each
    pool is read once per node, by the lowest rank there that uses it (a pool id is
    only a claim until the collective proves that ranks see one directory).

    Raises:
        PoolError: a pool could not be read (on every rank alike).
        WireError: a rank's answer is of another shape (naming it, on every rank).
        CollectiveTimeout: not every rank arrived in time.
    """
    seen = comm.allgather_object((pool.pool_id, str(pool.root), comm.node_id),
                                 timeout=timeout)
    ranks: dict[tuple[str, str, str], list[int]] = {}
    for rank, key in enumerate(seen):
        if not (type(key) is tuple and len(key) == 3 and all(type(v) is str for v in key)):
            raise _malformed("what the pools hold", rank, "pool (id, root, host)", key)
        ranks.setdefault(key, []).append(rank)
    bitmap: bytes | None = None
    failure: str | None = None
    if ranks[seen[comm.rank]][0] == comm.rank:
        try:
            flags = bytearray((len(artifacts) + 7) // 8)
            held = pool.holding([a.sha256 for a in artifacts])
            for i in (i for i, found in enumerate(held) if found):
                flags[i >> 3] |= 1 << (i & 7)
            bitmap = bytes(flags)
        except (DistcacheError, OSError) as exc:
            failure = f"rank {comm.rank} ({comm.node_id}): {type(exc).__name__}: {exc}"
    gathered = comm.allgather_object((bitmap, failure), timeout=timeout)
    # A pool's reader sends its bitmap (one bit per artifact) or its failure; every
    # other rank sends neither, so no rank speaks for a pool it did not read.
    readers, size = {r[0] for r in ranks.values()}, (len(artifacts) + 7) // 8
    for rank, sent in enumerate(gathered):
        if not (type(sent) is tuple and len(sent) == 2 and (
                (sent[0] is None and sent[1] is None) if rank not in readers else
                (type(sent[0]) is bytes and len(sent[0]) == size and sent[1] is None)
                or (sent[0] is None and type(sent[1]) is str))):
            raise _malformed("what the pools hold", rank, "(bitmap, failure) for "
                             + ("the pool it reads" if rank in readers else "a pool it does "
                                "not read"), sent)
    failed = next((f for _, f in gathered if f is not None), None)
    if failed is not None:
        raise PoolError(f"cannot tell what the pools hold: {failed}", path=None)
    maps = [b for b, _ in gathered if b is not None]
    held = [any(m[i >> 3] & (1 << (i & 7)) for m in maps) for i in range(len(artifacts))]
    where = [f"pool {pid} at {root} on {host} (rank{'s' if len(r) > 1 else ''} "
             f"{', '.join(map(str, r))})" for (pid, root, host), r in ranks.items()]
    if len(where) > _SHOWN_NAMES:
        where = [*where[:_SHOWN_NAMES], f"{len(where) - _SHOWN_NAMES} more pools"]
    return held, where


def missing_error(
    missing: Sequence[Artifact],
    *,
    offline: bool,
    where: Sequence[str],
    manifests: Sequence[str | os.PathLike[str]] = (),
) -> ConfigError:
    """The one error for artifacts that are in no pool when nothing may be downloaded:
    how many, the first names, the pools that lack them, and the command that fetches
    them. Built from data every rank holds alike, so every rank raises the same text."""
    names = ", ".join(a.name for a in missing[:_SHOWN_NAMES])
    more = f" and {len(missing) - _SHOWN_NAMES} more" if len(missing) > _SHOWN_NAMES else ""
    manifest = " ".join(f"--manifest {os.fspath(m)}" for m in manifests[:1]) or (
        "--manifest need.txt (the names and digests, in sha256sum format)")
    fetch = f"distcache fetch {manifest} --origin URL"
    if offline:
        why = "DISTCACHE_OFFLINE=1 forbids downloads"
        todo = (f"on a machine that reaches an origin run '{fetch}' and 'distcache pool "
                "export', then 'distcache pool import' here; or unset DISTCACHE_OFFLINE")
        variable, value = "DISTCACHE_OFFLINE", "1"
    else:
        why = "no origin is set"
        todo = (f"run '{fetch}', or set DISTCACHE_ORIGIN=URL (origin=... in "
                "distcache.init, --origin URL on the command line)")
        variable, value = "DISTCACHE_ORIGIN", None
    return ConfigError(
        f"{len(missing)} artifact(s) are in no pool and {why}: {names}{more}; "
        f"lacking from {'; '.join(where) or 'the pool'}; {todo}",
        variable=variable, value=value,
    )


def not_found(error: PrefetchError) -> str | None:
    """The artifact ``error`` names when the origin had no copy of it (the cause starts
    with the downloading rank's class name, ``ArtifactNotFound``), else ``None``. Only
    an agreed error counts: a transport's failure that one rank met alone does not."""
    cause, name = getattr(error, "cause", None), getattr(error, "artifact", None)
    found = (error.agreed and getattr(error, "phase", None) == "fetch" and isinstance(cause, str)
             and cause.startswith(f"{ArtifactNotFound.__name__}: "))
    return name if found and isinstance(name, str) else None


def warn_left_out(comm: Communicator, names: Sequence[str], why: str) -> None:
    """One warning, on rank 0, for the hints left out of a prefetch and why."""
    if comm.rank == 0:
        more = f" and {len(names) - _SHOWN_LEFT_OUT} more" if len(names) > _SHOWN_LEFT_OUT else ""
        log.warning("left %d artifact(s) out of the prefetch that only a usage record lists, "
                    "as %s: %s%s; a record is a hint: FlashInfer's own loader fetches such a "
                    "kernel when it is first used", len(names), why,
                    ", ".join(names[:_SHOWN_LEFT_OUT]), more)


def sent_carries(carried: list[Any]) -> list[tuple[bool, bool, str | None, bytes]]:
    """What each rank carried on the start-up prefetch's first agreement, checked to be
    as every rank sends it: (no origin, offline, the digest of what its integrations
    want or None, the key of its list).

    Raises:
        WireError: a rank sent something else (naming it), on every rank alike.
    """
    for rank, carry in enumerate(carried):
        if not (type(carry) is tuple and len(carry) == 4 and type(carry[0]) is bool
                and type(carry[1]) is bool and (carry[2] is None or type(carry[2]) is str)
                and type(carry[3]) is bytes):
            raise _malformed("prefetch", rank, "agreement (no origin, offline, records "
                             "digest, list key)", carry)
    return carried


def sent_lists(sent: list[Any]) -> list[tuple[int, bytes]]:
    """``(rank, compressed list)`` of each rank that sent its usage records' list, each
    checked to be ``(bytes, int)`` as every rank sends it, oldest first (ties by rank,
    alike everywhere).

    Raises:
        WireError: a rank sent something else (naming it), on every rank alike.
    """
    for rank, part in enumerate(sent):
        if part is not None and not (type(part) is tuple and len(part) == 2
                                     and type(part[0]) is bytes and type(part[1]) is int):
            raise _malformed("uniting the usage records", rank, "(list, date)", part)
    return [(rank, blob) for _, rank, blob in
            sorted((part[1], r, part[0]) for r, part in enumerate(sent) if part is not None)]


def listed_by(rank: int, blob: bytes) -> list[Artifact]:
    """The artifacts of rank ``rank``'s compressed list (:func:`sent_lists`). It is
    inflated a step at a time and refused once it passes ``MAX_MANIFEST_BYTES``, the
    most a manifest may hold, so that a small payload that inflates without end never
    fills this rank's memory.

    Raises:
        WireError: the list is not zlib data, inflates past the limit, or is not a
            manifest (naming the rank), on every rank alike.
    """
    inflate, pieces, size = zlib.decompressobj(), [], 0
    try:
        while not inflate.eof and size <= MAX_MANIFEST_BYTES:
            # At most one byte past the limit, which shows that the list passed it.
            piece = inflate.decompress(blob, min(_INFLATE_STEP, MAX_MANIFEST_BYTES + 1 - size))
            if not piece and not inflate.eof:
                break  # the input is spent before the stream's end: a cut-off list
            pieces.append(piece)
            size += len(piece)
            blob = inflate.unconsumed_tail
        if size > MAX_MANIFEST_BYTES:
            why = f"it inflates past {MAX_MANIFEST_BYTES} bytes (MAX_MANIFEST_BYTES)"
        elif not inflate.eof or inflate.unused_data:
            why = "it is not one whole zlib stream"
        else:
            text = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            return parse_checksums(text.decode())
    except (zlib.error, UnicodeDecodeError, ManifestError, ArtifactNameError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    raise _malformed("uniting the usage records", rank, f"list ({why:.200})")


def _malformed(doing: str, rank: int, what: str, *value: Any) -> WireError:
    """The error every rank raises alike for what ``rank`` sent (all received it): its
    ``value``, where given, shown in part."""
    shown = "".join(f" {v!r:.120}" for v in value)
    return WireError(f"{doing}: rank {rank} sent a malformed {what}{shown}", op="decode",
                     peer=rank, agreed=True)  # built from the all-gather: the same on every rank
