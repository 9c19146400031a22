"""Export a pool's artifacts as one tarball for an air-gapped transfer.

The tarball holds ``checksums.txt`` (first) and every artifact at its name, as plain
read-only files: the layout ``distcache pool import`` reads back, and the one a
:class:`~distcache.origins.DirOrigin` serves once unpacked. It is written to a
temporary file beside the target, flushed, then renamed over it, so the target is
either the old file or the whole new one. The compression follows the target's
suffix: ``.tar.gz``/``.tgz`` gzip, ``.tar.xz`` xz, anything else uncompressed
(cubins compress about 4:1, but gzip runs near 50 MB/s on one core).
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from distcache.artifact import Artifact, manifest_text
from distcache.errors import PoolError
from distcache.store._import import Progress
from distcache.store._pool import ArtifactPool

_SHOWN_MISSING = 5


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What :func:`export_tar` wrote."""

    target: str
    artifacts: int
    bytes: int


def _mode(target: Path) -> str:
    name = target.name.lower()
    if name.endswith((".tar.gz", ".tgz")):
        return "w:gz"
    if name.endswith((".tar.xz", ".txz")):
        return "w:xz"
    return "w"


def _info(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o444
    info.mtime = int(mtime)
    return info


def missing_from(pool: ArtifactPool, artifacts: list[Artifact]) -> list[Artifact]:
    """The artifacts whose object ``pool`` lacks."""
    return [a for a in artifacts if not pool.has(a.sha256)]


def export_tar(pool: ArtifactPool, artifacts: list[Artifact], target: Path,
               progress: Progress | None = None) -> ExportReport:
    """Write ``artifacts`` (each read and verified from ``pool``) and their
    ``checksums.txt`` into the tarball ``target``, atomically.

    Raises:
        PoolError: an artifact is missing from the pool or corrupt there, or the
            target's directory does not exist (nothing is written in either case).
        OSError: the target cannot be written (the temporary file is removed).
    """
    absent = missing_from(pool, artifacts)
    if absent:
        names = ", ".join(a.name for a in absent[:_SHOWN_MISSING])
        raise PoolError(f"cannot export: {len(absent)} artifact(s) are not in pool "
                        f"{pool.root}: {names}; fetch them first (distcache fetch "
                        "--manifest FILE)", path=str(pool.root))
    target = target.absolute()
    if not target.parent.is_dir():
        raise PoolError(f"cannot export to {target}: {target.parent} is not a directory",
                        path=str(target))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    now = time.time()
    total = 0
    if progress is not None:
        progress.phase("exporting", sum(a.size or 0 for a in artifacts) or None)
    try:
        with open(tmp, "xb") as raw:
            with tarfile.open(fileobj=raw, mode=_mode(target),
                              format=tarfile.PAX_FORMAT) as archive:  # type: ignore[call-overload]
                manifest = manifest_text(artifacts).encode()
                archive.addfile(_info("checksums.txt", len(manifest), now), io.BytesIO(manifest))
                for artifact in artifacts:
                    data = pool.get(artifact.sha256)
                    if data is None:
                        raise PoolError(f"cannot export {artifact.name}: its object "
                                        f"{artifact.sha256} in {pool.root} is corrupt (moved "
                                        "to quarantine/); fetch it again", path=str(pool.root))
                    archive.addfile(_info(artifact.name, len(data), now), io.BytesIO(data))
                    total += len(data)
                    if progress is not None:
                        progress.advance(len(data))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return ExportReport(target=str(target), artifacts=len(artifacts), bytes=total)
