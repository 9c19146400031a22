"""Export a pool's artifacts as one tarball for an air-gapped transfer.

The tarball holds ``checksums.txt`` (first) and every artifact at its name, as plain
read-only files: the layout ``distcache pool import`` reads back, and the one a
:class:`~distcache.origins.DirOrigin` serves once unpacked. It is written to a
temporary file beside the target, flushed, then renamed over it, so the target is
either the old file or the whole new one. The compression follows the target's
suffix: ``.tar`` none, ``.tar.gz``/``.tgz`` gzip, ``.tar.bz2``/``.tbz2`` bzip2,
``.tar.xz``/``.txz`` xz (cubins compress about 4:1, but gzip runs near 50 MB/s on one
core); any other suffix is refused before anything is written, as is an artifact
named ``checksums.txt`` at the top, whose place the set's own manifest takes.
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
from distcache.errors import ConfigError, PoolError
from distcache.store._import import Progress
from distcache.store._pool import ArtifactPool

_SHOWN_MISSING = 5
MANIFEST = "checksums.txt"
#: Every tarball suffix ``pool import`` reads, and the mode that writes it.
_MODES = {".tar": "w", ".tar.gz": "w:gz", ".tgz": "w:gz", ".tar.bz2": "w:bz2",
          ".tbz2": "w:bz2", ".tar.xz": "w:xz", ".txz": "w:xz"}


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What :func:`export_tar` wrote."""

    target: str
    artifacts: int
    bytes: int


def _mode(target: Path) -> str:
    name = target.name.lower()
    for suffix, mode in sorted(_MODES.items(), key=lambda item: -len(item[0])):
        if name.endswith(suffix):
            return mode
    raise ConfigError(f"cannot export to {target}: the name must end in one of "
                      f"{', '.join(_MODES)} (the suffix picks the compression, and "
                      "pool import reads the tarball back by it)",
                      variable="--tar", value=str(target))


def check_names(artifacts: list[Artifact]) -> None:
    """Refuse a selection with an artifact named ``checksums.txt`` at the top: an
    exported set keeps its own manifest there, and import reads that file as the
    set's manifest, never as an artifact.

    Raises:
        ConfigError: such an artifact is selected.
    """
    if any(a.name == MANIFEST for a in artifacts):
        raise ConfigError(f"cannot export an artifact named {MANIFEST}: the exported set "
                          f"keeps its own {MANIFEST} at the top; leave it out with "
                          "--manifest M", variable="--manifest", value=MANIFEST)


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
        ConfigError: the target's suffix is not one import reads back, or an
            artifact is named ``checksums.txt`` (nothing is written).
        OSError: the target cannot be written (the temporary file is removed).
    """
    mode = _mode(target)
    check_names(artifacts)
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
            with tarfile.open(fileobj=raw, mode=mode,
                              format=tarfile.PAX_FORMAT) as archive:  # type: ignore[call-overload]
                manifest = manifest_text(artifacts).encode()
                archive.addfile(_info(MANIFEST, len(manifest), now), io.BytesIO(manifest))
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
