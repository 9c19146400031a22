"""Collective warm-up of FlashInfer artifacts: usage records and whole families.

:func:`prefetch` hands what every rank recorded in earlier runs (see
:mod:`distcache.integrations.flashinfer._record`), plus any manifest and any whole
artifact family, to the one start-up prefetch
(:func:`distcache._resolve.prefetch_manifests`), so each missing artifact is fetched
once per job and broadcast to the pools that lack it.

A family is one of FlashInfer's artifact pins (``ArtifactPath``). Its
``checksums.txt`` lists every file with its sha256, and FlashInfer pins the sha256
of that manifest itself (``CheckSumHash``), so the chain of trust ends in the
installed FlashInfer package.

Architectures. A family holds kernels for several GPU architectures; ``archs``
keeps only those a node's GPUs can load (:func:`arch_filter` has the rule).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache._resolve import ManifestSpec, prefetch_manifests
from distcache.artifact import Artifact, decode_manifest, parse_checksums
from distcache.collective import prefetch as collective_prefetch
from distcache.comm import Communicator, agree_on_error
from distcache.errors import ConfigError, DistcacheError, OriginError
from distcache.integrations.flashinfer._integration import FlashInfer
from distcache.integrations.flashinfer._upstream import default_origin

if TYPE_CHECKING:
    from distcache.collective import PrefetchReport
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = get_logger(__name__)


# FlashInfer spells the architecture a kernel was built for in its name or directory:
# "fmhaSm100aKernel_...", "..._sm100f.cubin", "cute-dsl/x86_64/sm_103a/...".
# ASCII digits only (other scripts' digits name no architecture), no leading zero.
_ARCH_TOKEN = re.compile(r"sm_?(\d{2,3})([af]?)(?![0-9])", re.IGNORECASE | re.ASCII)
# One value of TORCH_CUDA_ARCH_LIST's forms too: "9.0a", "10.0f", "9.0+PTX".
_ARCH_ARG = re.compile(r"(?:(?:sm_?)?([1-9]\d{1,2})|([1-9]\d?)\.(\d))[af]?(?:\+ptx)?",
                       re.IGNORECASE | re.ASCII)

ARCH_RULE = """\
A name that mentions an architecture (sm100a, Sm100a, _sm100f, sm_103a/) is kept when
it can run on one of the given GPUs: 'a' (architecture-specific) kernels on exactly that
architecture, 'f' (family) and plain kernels on that architecture and the later ones of
the same major version (sm100f on sm_100 and sm_103). Names that mention none
(headers, checksums.txt, deep-gemm) are always kept."""


def parse_arch(text: str) -> int:
    """The compute capability in ``text`` as an integer: ``"sm_90"``, ``"sm_100a"``,
    ``"100"`` and ``"10.0"`` give 90, 100, 100, 100; so do TORCH_CUDA_ARCH_LIST's
    ``"10.0a"`` and ``"9.0+PTX"`` (100, 90).

    Raises:
        ConfigError: none of those forms, or several architectures in one value.
    """
    match = _ARCH_ARG.fullmatch(text.strip())
    if match is None:
        parts = re.split(r"[;,\s]+", text.strip())
        several = len(parts) > 1 and all(_ARCH_ARG.fullmatch(p) for p in parts)
        hint = "one architecture per --arch: repeat it" if several else "expected e.g."
        raise ConfigError(f"--arch: bad GPU architecture {text!r}: {hint} (sm_90, sm_100a "
                          "or 9.0)", variable="--arch", value=text)
    if match.group(1) is not None:
        return int(match.group(1))
    return int(match.group(2)) * 10 + int(match.group(3))


def _runs_on(built: int, kind: str, gpu: int) -> bool:
    if kind == "a":
        return built == gpu
    return built // 10 == gpu // 10 and gpu >= built


def arch_filter(archs: Iterable[str]) -> Callable[[str], bool]:
    """Whether an artifact name is wanted on a node with GPUs of ``archs`` (see
    :data:`ARCH_RULE`); every name when ``archs`` is empty.

    Raises:
        ConfigError: a malformed architecture.
    """
    gpus = sorted({parse_arch(a) for a in archs})

    def wanted(name: str) -> bool:
        tokens = _ARCH_TOKEN.findall(name)
        if not gpus or not tokens:
            return True
        return any(_runs_on(int(num), kind.lower(), gpu) for num, kind in tokens for gpu in gpus)

    return wanted


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
    :func:`~distcache.integrations.flashinfer.default_origin`), through ``pool`` when
    given, and verified against FlashInfer's pinned hash. Not collective.

    Raises:
        ConfigError: unknown family or unpinned manifest (see :func:`family_checksums`).
        OriginError: the pinned manifest could not be fetched or did not verify.
        ManifestError: the manifest is malformed.
    """
    checksums = family_checksums(family, sha256)
    if origin is None:
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


def expand_families(
    comm: Communicator,
    pool: ArtifactPool,
    origin: Origin,
    families: Sequence[str],
    *,
    timeout: float | None = None,
) -> list[Artifact]:
    """Collective: every artifact of the named ``families``. Their pinned
    ``checksums.txt`` files are prefetched first (each fetched once per job), then
    read from the pool.

    Raises:
        ConfigError: an unknown family or an unpinned manifest (on every rank).
        OriginError: a pinned manifest could not be fetched (on every rank).
        ManifestError: a malformed pinned manifest (on every rank).
    """
    pinned: list[Artifact] = []
    error: BaseException | None = None
    try:
        pinned = [family_checksums(f) for f in families]
    except DistcacheError as exc:
        error = exc
    agree_on_error(comm, error, timeout=timeout)
    if not pinned:
        return []
    collective_prefetch(pinned, comm=comm, pool=pool, origin=origin, timeout=timeout)
    listed: list[Artifact] = []
    try:
        for checksums in pinned:
            data = pool.get(checksums.sha256)
            if data is None:
                raise OriginError(
                    f"the pinned manifest {checksums.name} is missing from pool "
                    f"{pool.root} right after it was prefetched",
                    name=checksums.name,
                )
            listed += [checksums, *_parse_family(checksums, data)]
    except DistcacheError as exc:
        error = exc
    agree_on_error(comm, error, timeout=timeout)
    return listed


def prefetch(
    *,
    comm: Communicator,
    pool: ArtifactPool,
    manifest: ManifestSpec | None = None,
    record: str | os.PathLike[str] | None = None,
    origin: Origin | None = None,
    families: Sequence[str] = (),
    archs: Sequence[str] = (),
    timeout: float | None = None,
) -> PrefetchReport:
    """Collective: make every artifact any rank recorded (plus ``manifest`` and whole
    ``families``) present in every rank's pool, fetching each from the origin once.
``archs`` (e.g. ``("sm_90",)``) keeps only the family kernels those GPUs can load.

    Every rank must call it. Record files are read on each rank where the directory
    is visible and the union is taken across ranks. ``origin`` defaults to
    :func:`~distcache.integrations.flashinfer.default_origin`.

    Raises:
        ManifestError: one name with two digests across records or manifests (on
            every rank), or a malformed record.
        ConfigError: unreadable manifest, unknown family, bad architecture, no origin.
        OriginError: a family's pinned manifest could not be fetched.
        PrefetchError: the collective fetch failed (on every rank).
        CollectiveTimeout: not every rank arrived in time.
    """
    error: BaseException | None = None
    keep: Callable[[str], bool] = arch_filter(())
    try:
        keep = arch_filter(archs)
        if origin is None:
            origin = default_origin()
    except DistcacheError as exc:
        error = exc
    agree_on_error(comm, error, timeout=timeout)
    assert origin is not None  # resolved above, or every rank raised
    manifests: list[ManifestSpec] = [manifest] if manifest is not None else []
    if families:
        listed = expand_families(comm, pool, origin, families, timeout=timeout)
        manifests.append([a for a in listed if keep(a.name)])
    report = prefetch_manifests(comm, pool, origin, manifests=manifests,
                                integrations=[FlashInfer(record)] if record is not None else [],
                                timeout=timeout)
    if report is None:
        # Nothing recorded anywhere: an empty collective still returns a report that
        # every rank agrees on, as callers print it.
        report = collective_prefetch([], comm=comm, pool=pool, origin=origin, timeout=timeout)
    return report
