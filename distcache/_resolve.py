"""Settings -> pool -> origin -> start-up prefetch, written once for the session, the
CLI and the FlashInfer warm-up.

An explicit argument wins, then the ``DISTCACHE_*`` setting, then what an integration
offers (FlashInfer's own repository, say); see ``distcache.config`` for the table of
defaults. :func:`prefetch_manifests` is the one start-up prefetch: manifests every
rank passes alike, plus what each rank's integrations want (usage records differ per
rank, so those are united across ranks first), merged by
:func:`distcache.artifact.merge_manifests` and fetched once per job.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from distcache.artifact import (
    Artifact,
    manifest_text,
    merge_manifests,
    parse_checksums,
    read_manifest,
    sha256_hex,
)
from distcache.collective import PrefetchReport
from distcache.collective import prefetch as collective_prefetch
from distcache.comm import Communicator, agree_on_error
from distcache.config import Settings
from distcache.errors import ConfigError, DistcacheError, PoolError
from distcache.origins import Origin, open_origin
from distcache.store import ArtifactPool, PoolLayout

if TYPE_CHECKING:
    from distcache.integrations import Integration

#: A ``sha256sum``-format file, or a list of artifacts.
ManifestSpec = str | os.PathLike[str] | Sequence[Artifact]


def resolve_pool(
    pool: ArtifactPool | str | os.PathLike[str] | None,
    conf: Settings,
    *,
    must_exist: bool = False,
) -> ArtifactPool:
    """The pool to use: ``pool`` when given (an open pool or a directory), else
    ``conf.pool_dir``, capped at ``conf.pool_max_bytes``.

    Raises:
        PoolError: ``must_exist`` and there is no pool at the directory, or the pool
            cannot be opened or created.
    """
    if isinstance(pool, ArtifactPool):
        return pool
    root = Path(pool) if pool is not None else conf.pool_dir
    if must_exist and not PoolLayout(root).is_pool():
        raise PoolError(
            f"no pool at {root} (no objects/ directory); pass --pool DIR or set "
            "DISTCACHE_POOL, or create one with 'distcache fetch' or 'distcache pool import'",
            path=str(root),
        )
    return ArtifactPool(root, max_bytes=conf.pool_max_bytes)


def resolve_origin(
    origin: Origin | str | Sequence[str | Origin] | None,
    conf: Settings,
    integrations: Iterable[Integration] = (),
) -> Origin | None:
    """The origin to use: ``origin`` when given, else ``DISTCACHE_ORIGIN``, else the
    first default an integration offers; ``None`` when there is none.

    Raises:
        ConfigError: a spec names an unknown scheme or a directory that is not one.
    """
    if origin is not None:
        return open_origin(origin)
    if conf.origins:
        return open_origin(list(conf.origins))
    for integration in integrations:
        spec = integration.default_origin()
        if spec:
            return open_origin(spec)
    return None


def prefetch_manifests(
    comm: Communicator,
    pool: ArtifactPool,
    origin: Origin | None,
    *,
    manifests: Sequence[ManifestSpec] = (),
    integrations: Sequence[Integration] = (),
    timeout: float | None = None,
) -> PrefetchReport | None:
    """Collective: every artifact of ``manifests`` (the same on every rank) and of any
    rank's ``integrations`` reaches every pool, each fetched from ``origin`` once.

    Returns ``None`` (on every rank alike) when there is nothing to prefetch. Nothing
    collective runs when neither manifests nor integrations are given.

    Raises:
        ConfigError: ``manifests`` is a single path, a manifest cannot be read, or
            there is something to fetch and no origin (on every rank).
        ManifestError: a malformed manifest or record, or one name with two digests
            (on every rank).
        ManifestMismatchError: ranks passed different manifests (on every rank).
        PrefetchError: a download or transfer failed (on every rank).
        CollectiveTimeout: not every rank arrived in time.
    """
    if isinstance(manifests, str | os.PathLike):
        raise ConfigError(
            "manifests must be a list of files or artifact lists, not a single path",
            variable="manifests", value=str(manifests),
        )
    if not manifests and not integrations:
        return None
    listed: list[Artifact] = []
    wanted: list[Artifact] = []
    error: BaseException | None = None
    try:
        listed = merge_manifests(_read(spec, i) for i, spec in enumerate(manifests))
        wanted = merge_manifests((i.name, i.manifest()) for i in integrations)
    except DistcacheError as exc:
        error = exc
    # A rank that cannot read its manifest or record must not leave the others waiting.
    agree_on_error(comm, error, timeout=timeout)
    artifacts = listed
    if integrations:
        everyone = union_across_ranks(comm, wanted, timeout=timeout)
        if everyone:
            try:
                artifacts = merge_manifests([("manifests", listed),
                                             ("integrations of every rank", everyone)])
            except DistcacheError as exc:
                error = exc
            agree_on_error(comm, error, timeout=timeout)
    if not artifacts:
        return None
    if origin is None:
        raise ConfigError(
            f"{len(artifacts)} artifact(s) to prefetch but no origin: pass origin=... or "
            "set DISTCACHE_ORIGIN",
            variable="DISTCACHE_ORIGIN", value=None,
        )
    return collective_prefetch(artifacts, comm=comm, pool=pool, origin=origin, timeout=timeout)


def _read(spec: ManifestSpec, index: int) -> tuple[str, list[Artifact]]:
    if isinstance(spec, str | os.PathLike):
        return os.fspath(spec), read_manifest(spec)
    return f"manifests[{index}]", list(spec)


def union_across_ranks(
    comm: Communicator, artifacts: Sequence[Artifact], *, timeout: float | None = None
) -> list[Artifact]:
    """Collective: the union of every rank's ``artifacts``, the same list on every rank.

    Ranks that read the same files (a shared record directory) send their list once:
    digests first, then one copy of each distinct list. When every rank's list is
    empty that is a single small all-gather.

    Raises:
        ManifestError: one name with two digests across ranks (on every rank).
        CollectiveTimeout: not every rank arrived in time.
    """
    text = manifest_text(artifacts).encode()
    digest = sha256_hex(text) if artifacts else None
    digests = comm.allgather_object(digest, timeout=timeout)
    if not any(digests):
        return []
    mine = zlib.compress(text) if digest is not None and digests.index(digest) == comm.rank else None
    blobs = comm.allgather_object(mine, timeout=timeout)
    return merge_manifests(
        (f"rank {rank}", parse_checksums(zlib.decompress(blob).decode()))
        for rank, blob in enumerate(blobs)
        if blob is not None
    )
