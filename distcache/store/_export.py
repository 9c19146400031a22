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

The plain-directory export (:func:`export_directory`) places each artifact the way
:func:`~distcache.store._materialize.materialize` does and merges the set into the
directory's ``checksums.txt``, which is replaced the same way. Both only read the
pool: no label is recorded there. Each temporary file is created exclusively, never
through a link, under a name with random bits (:func:`_create_temp`), so a file or
link another process left at a guessed name is neither written through nor removed.
"""

from __future__ import annotations

import io
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from distcache.artifact import Artifact, manifest_text, read_manifest
from distcache.errors import ConfigError, PoolError
from distcache.store._fs import process_umask, replace_from, temp_file, unlink_quietly
from distcache.store._import import Progress
from distcache.store._materialize import materialize
from distcache.store._pool import ArtifactPool

_SHOWN_MISSING = 5
MANIFEST = "checksums.txt"
#: Every tarball suffix ``pool import`` reads, and the mode that writes it.
_MODES = {".tar": "w", ".tar.gz": "w:gz", ".tgz": "w:gz", ".tar.bz2": "w:bz2",
          ".tbz2": "w:bz2", ".tar.xz": "w:xz", ".txz": "w:xz"}
#: The mode a finished tarball or checksums.txt takes (less the umask): that of a file
#: created plainly, since a transfer set is for others to read.
_FILE_MODE = 0o666


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


def _temp_path(target: Path) -> Path:
    """A fresh name beside ``target`` for the file that becomes it: process-unique
    (pid and random bits), so neither a stale file of a killed run whose pid came
    round again nor another host's export on a shared volume holds it."""
    return target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")


def _create_temp(target: Path) -> tuple[Path, int]:
    """Create the temporary file that becomes ``target`` (named by :func:`_temp_path`)
    as the pool creates its own: exclusively, never through a link, mode ``0600``.
    Its path and a descriptor open on it; removing that path later removes only a
    file this call created.

    Raises:
        PoolError: it cannot be created (nothing was created).
    """
    tmp = _temp_path(target)
    try:
        return tmp, temp_file(str(tmp))
    except PoolError as exc:
        raise PoolError(f"cannot export to {target}: {exc}; check that you can write to "
                        f"{target.parent} and that no other file or link has taken that "
                        "name, then export again", path=str(target), errno=exc.errno) from exc


def _seal(fd: int) -> None:
    """Give the finished temporary file open as ``fd`` its final mode and flush it."""
    os.fchmod(fd, _FILE_MODE & ~process_umask())
    os.fsync(fd)


def export_directory(pool: ArtifactPool, artifacts: list[Artifact], directory: Path) -> None:
    """Place ``artifacts`` (each read and verified from ``pool``) at their names under
    the existing ``directory``, and list them in its ``checksums.txt`` together with
    the entries already there; that file is written whole to a temporary file, then
    renamed over the old one.

    The pool is only read: unlike :meth:`ArtifactPool.materialize`, no label is
    recorded, so exporting another set's manifest does not rename the pool's
    artifacts, and a pool whose ``names.log`` cannot be written exports all the same.

    Raises:
        PoolError: an object is missing from the pool or corrupt there, or a file
            cannot be written (the temporary file is removed and the old
            ``checksums.txt`` kept; artifacts placed already stay).
        ArtifactNameError: a name is unsafe (checked before its file is written).
        IntegrityError: an object's size is not the one its artifact declares.
    """
    manifest = directory / MANIFEST
    listed = {a.name: a for a in read_manifest(manifest)} if manifest.is_file() else {}
    tmp, fd = _create_temp(manifest)
    try:
        for artifact in artifacts:
            # The store's materialize: the pool's own would also record the label.
            materialize(pool._store, artifact, directory)
            listed[artifact.name] = artifact
        text = manifest_text(sorted(listed.values(), key=lambda a: a.name))
        replace_from(fd, tmp, manifest, text.encode("utf-8"), _FILE_MODE & ~process_umask())
    except BaseException:
        unlink_quietly(tmp)
        raise
    finally:
        os.close(fd)


def export_tar(pool: ArtifactPool, artifacts: list[Artifact], target: Path,
               progress: Progress | None = None) -> ExportReport:
    """Write ``artifacts`` (each read and verified from ``pool``) and their
    ``checksums.txt`` into the tarball ``target``, atomically.

    Raises:
        PoolError: an artifact is missing from the pool or corrupt there, the
            target's directory does not exist, or the temporary file beside the
            target cannot be created (nothing is written in any case).
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
    tmp, fd = _create_temp(target)
    now = time.time()
    total = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            if progress is not None:
                progress.phase("exporting", sum(a.size or 0 for a in artifacts) or None)
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
            _seal(raw.fileno())
        os.replace(tmp, target)
    except BaseException:
        # Created by this call (exclusively, above): removing it removes nobody else's.
        unlink_quietly(tmp)
        raise
    return ExportReport(target=str(target), artifacts=len(artifacts), bytes=total)
