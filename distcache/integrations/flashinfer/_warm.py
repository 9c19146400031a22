"""Collective warm-up of FlashInfer artifacts: usage records and whole families.

:func:`prefetch` merges what every rank recorded in earlier runs (see
:mod:`distcache.integrations.flashinfer._record`), plus any manifest and any whole
artifact family, and hands the union to :func:`distcache.collective._core.prefetch`, so each
missing artifact is fetched once per job and broadcast to the pools that lack it.

A family is one of FlashInfer's artifact pins (``ArtifactPath``). Its
``checksums.txt`` lists every file with its sha256, and FlashInfer pins the sha256
of that manifest itself (``CheckSumHash``), so the chain of trust ends in the
installed FlashInfer package.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING

from distcache.artifact import (
    Artifact,
    decode_manifest,
    manifest_text,
    parse_checksums,
    read_manifest,
    sha256_hex,
)
from distcache.comm._base import Communicator, agree_on_error
from distcache.errors import ConfigError, DistcacheError, OriginError
from distcache.integrations.flashinfer._record import merge_entries, read_record

if TYPE_CHECKING:
    from distcache.collective._core import PrefetchReport
    from distcache.origins._origin import Origin
    from distcache.store._pool import ArtifactPool

__all__ = ["family_checksums", "family_manifest", "family_names", "prefetch"]

log = logging.getLogger(__name__)

ManifestArg = str | os.PathLike[str] | Sequence[Artifact]


def _pins() -> dict[str, tuple[str, str | None]]:
    """``FAMILY -> (pin directory, pinned sha256 of its checksums.txt or None)``."""
    try:
        from flashinfer.artifacts import ArtifactPath, CheckSumHash
        from flashinfer.jit.cubin_loader import safe_urljoin
    except Exception as exc:
        raise ConfigError(
            f"FlashInfer is not importable ({type(exc).__name__}: {exc}); artifact "
            "families come from the installed flashinfer-python",
            variable="family",
            value=None,
        ) from exc
    pinned: Mapping[str, str] = getattr(CheckSumHash, "map_checksums", {})
    paths = ArtifactPath()
    table: dict[str, tuple[str, str | None]] = {}
    names = [f.name for f in fields(paths)] if is_dataclass(paths) else list(vars(ArtifactPath))
    for attr in names:
        value = getattr(paths, attr, None)
        if not isinstance(value, str) or attr.startswith("_"):
            continue
        directory = value if value.endswith("/") else value + "/"
        table[attr.upper()] = (directory, pinned.get(safe_urljoin(directory, "checksums.txt")))
    # Families published per CPU and GPU architecture (cute-dsl): one entry each.
    for key, sha in pinned.items():
        directory = key[: -len("checksums.txt")]
        if not any(d == directory for d, _ in table.values()):
            for attr, (base, _) in list(table.items()):
                if directory.startswith(base):
                    table[f"{attr}/{directory[len(base):].rstrip('/')}".upper()] = (directory, sha)
    return table


def family_names() -> list[str]:
    """The family names :func:`family_manifest` accepts (from the installed FlashInfer).

    Raises:
        ConfigError: FlashInfer is not importable.
    """
    return sorted(_pins())


def family_checksums(family: str, sha256: str | None = None) -> Artifact:
    """The ``checksums.txt`` artifact of ``family`` with its pinned sha256.

    ``family`` is a name from :func:`family_names` (case-insensitive) or a pin
    directory. ``sha256`` is needed only for a directory FlashInfer does not pin.

    Raises:
        ConfigError: unknown family, or no pinned hash and no ``sha256``.
    """
    table = _pins()
    entry = table.get(family.upper())
    if entry is None:
        directory = family if family.endswith("/") else family + "/"
        entry = next(((d, s) for d, s in table.values() if d == directory), (directory, None))
        if entry[1] is None and sha256 is None and family.upper() not in table:
            looks_like_path = "/" in family.rstrip("/")
            if not looks_like_path:
                raise ConfigError(
                    f"unknown FlashInfer artifact family {family!r}; known: "
                    f"{', '.join(sorted(table))}, or a pin directory",
                    variable="family",
                    value=family,
                )
    directory, pinned = entry
    sha = sha256 if sha256 is not None else pinned
    if sha is None:
        raise ConfigError(
            f"FlashInfer pins no sha256 for {directory}checksums.txt; pass its sha256 "
            "explicitly so the manifest can be verified",
            variable="family",
            value=family,
        )
    if pinned is not None and sha256 is not None and sha256 != pinned:
        log.warning("%schecksums.txt: using the given sha256 %s instead of FlashInfer's pin %s",
                    directory, sha256, pinned)
    return Artifact(directory + "checksums.txt", sha)


def family_manifest(
    family: str,
    origin: Origin | None = None,
    *,
    pool: ArtifactPool | None = None,
    sha256: str | None = None,
) -> list[Artifact]:
    """Every artifact of a FlashInfer family: its ``checksums.txt`` (first) and the
    files it lists, with names relative to the repository root.

    The manifest is fetched from ``origin`` (default:
    :func:`distcache.integrations.flashinfer.default_origin`), through ``pool`` when
    given, and verified against FlashInfer's pinned hash. Not collective.

    Raises:
        ConfigError: unknown family or unpinned manifest (see :func:`family_checksums`).
        OriginError: the pinned manifest could not be fetched or did not verify.
        ManifestError: the manifest is malformed.
    """
    checksums = family_checksums(family, sha256)
    if origin is None:
        from distcache.integrations.flashinfer import default_origin

        origin = default_origin()
    try:
        data = pool.fetch(checksums, origin) if pool is not None else origin.fetch(checksums)
    except DistcacheError as exc:
        raise OriginError(
            f"cannot fetch the pinned manifest {checksums.name} (sha256 {checksums.sha256}) "
            f"of FlashInfer family {family!r} from {origin.describe()}: {exc}; check "
            "FLASHINFER_CUBINS_REPOSITORY / DISTCACHE_ORIGIN, and that the mirror matches "
            "the installed flashinfer-python version",
            name=checksums.name,
            url=origin.describe(),
            status=getattr(exc, "status", None),
        ) from exc
    return [checksums, *_parse_family(checksums, data)]


def _parse_family(checksums: Artifact, data: bytes) -> list[Artifact]:
    directory = checksums.name[: -len("checksums.txt")]
    return parse_checksums(decode_manifest(data, source=checksums.name), prefix=directory)


def _load_manifest(manifest: ManifestArg) -> dict[str, str]:
    items = read_manifest(manifest) if isinstance(manifest, str | os.PathLike) else manifest
    return _entries(items)


def _entries(artifacts: Iterable[Artifact]) -> dict[str, str]:
    return {a.name: a.sha256 for a in artifacts}


def _merged(*parts: tuple[str, Mapping[str, str]]) -> dict[str, str]:
    return _entries(merge_entries(parts))


def _union(comm: Communicator, entries: Mapping[str, str], timeout: float | None) -> list[Artifact]:
    """Union of every rank's entries. Ranks that read the same files (a shared record
    directory) contribute their bytes once: digests first, then one copy of each."""
    text = manifest_text(Artifact(n, s) for n, s in sorted(entries.items())).encode()
    digest = sha256_hex(text)
    digests = comm.allgather_object(digest, timeout=timeout)
    mine = zlib.compress(text) if digests.index(digest) == comm.rank else None
    blobs = comm.allgather_object(mine, timeout=timeout)
    parts = []
    for rank, blob in enumerate(blobs):
        if blob is not None:
            listed = parse_checksums(zlib.decompress(blob).decode())
            parts.append((f"rank {rank}", _entries(listed)))
    return merge_entries(parts)


def prefetch(
    *,
    comm: Communicator,
    pool: ArtifactPool,
    manifest: ManifestArg | None = None,
    record: str | os.PathLike[str] | None = None,
    origin: Origin | None = None,
    families: Sequence[str] = (),
    timeout: float | None = None,
) -> PrefetchReport:
    """Collective: make every artifact any rank recorded (plus ``manifest`` and whole
    ``families``) present in every rank's pool, fetching each from the origin once.

    Every rank must call it. Record files are read on each rank where the directory
    is visible and the union is taken across ranks.

    Raises:
        ManifestError: one name with two digests across records or manifests (on
            every rank), or a malformed record.
        ConfigError: unreadable manifest, unknown family, no origin.
        OriginError: a family's pinned manifest could not be fetched.
        PrefetchError: the collective fetch failed (on every rank).
        CollectiveTimeout: not every rank arrived in time.
    """
    from distcache.collective._core import prefetch as collective_prefetch

    entries: dict[str, str] = {}
    pinned: list[Artifact] = []
    error: BaseException | None = None
    try:
        if origin is None:
            from distcache.integrations.flashinfer import default_origin

            origin = default_origin()
        if manifest is not None:
            entries.update(_load_manifest(manifest))
        if record is not None:
            entries = _merged(("manifest", entries), (str(record), read_record(record)))
        pinned = [family_checksums(f) for f in families]
    except DistcacheError as exc:
        error = exc
    agree_on_error(comm, error, timeout=timeout)
    assert origin is not None  # resolved above, or every rank raised

    if pinned:
        collective_prefetch(pinned, comm=comm, pool=pool, origin=origin, timeout=timeout)
        try:
            for checksums in pinned:
                data = pool.get(checksums.sha256)
                if data is None:
                    raise OriginError(
                        f"the pinned manifest {checksums.name} is missing from pool "
                        f"{pool.root} right after it was prefetched",
                        name=checksums.name,
                    )
                listed = [checksums, *_parse_family(checksums, data)]
                entries = _merged(("records", entries), (checksums.name, _entries(listed)))
        except DistcacheError as exc:
            error = exc
        agree_on_error(comm, error, timeout=timeout)

    artifacts = _union(comm, entries, timeout)
    log.info("flashinfer prefetch: %d artifact(s) from records/manifests/families",
             len(artifacts))
    return collective_prefetch(artifacts, comm=comm, pool=pool, origin=origin, timeout=timeout)
