"""Export a pool's artifacts as one tarball or one directory for an air-gapped transfer.

The tarball holds ``checksums.txt`` (first) and every artifact at its name, as plain
read-only files: the layout ``distcache pool import`` reads back, and the one a
:class:`~distcache.origins.DirOrigin` serves once unpacked. It is written to a
temporary file beside the target, flushed, then renamed over it, so the target is
either the old file or the whole new one, and the directory is flushed after the
rename; a target that is a symbolic link stays one, and the file it points at is
replaced (as ``tar -cf`` writes through it). The compression follows the target's
suffix: ``.tar`` none, ``.tar.gz``/``.tgz`` gzip, ``.tar.bz2``/``.tbz2`` bzip2,
``.tar.xz``/``.txz`` xz (cubins compress about 4:1, but gzip runs near 50 MB/s on one
core); any other suffix is refused before anything is written, as is an artifact
named ``checksums.txt`` at the top, whose place the set's own manifest takes, and one
named ``<dir>/checksums.txt`` that import would refuse (:func:`check_manifests`).

The plain-directory export (:func:`export_directory`) is all or nothing too: the whole
tree is built in a fresh directory beside the target, then renamed into place.

Neither export changes what the pool holds: no label is recorded there, and every
exported file is a copy of the verified bytes, never a link to the pool's object, so
writing to an exported file cannot corrupt the pool (an object found corrupt is
quarantined, as any read does, and named in the error). Temporary files and
directories are created exclusively, never through a link, under names with random
bits (:func:`_temp_path`): nothing another process left at a guessed name is written
through or removed.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import stat
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import Artifact, decode_manifest, manifest_text, parse_checksums
from distcache.errors import ArtifactNameError, ConfigError, ManifestError, PoolError
from distcache.store._fs import (
    fsync_dir,
    process_umask,
    temp_file,
    unlink_quietly,
)
from distcache.store._import import Progress
from distcache.store._mirror import (
    beside as _temp_path,
)
from distcache.store._mirror import (
    built_inside,
    carried,
    earlier_export,
    flush_tree,
    move_into,
    remove_tree,
    staging,
    undo,
    write_file,
)
from distcache.store._objects import check_size
from distcache.store._pool import ArtifactPool

logger = get_logger(__name__)

_SHOWN_MISSING = 5
MANIFEST = "checksums.txt"
#: Every tarball suffix ``pool import`` reads, and the mode that writes it.
_MODES = {".tar": "w", ".tar.gz": "w:gz", ".tgz": "w:gz", ".tar.bz2": "w:bz2",
          ".tbz2": "w:bz2", ".tar.xz": "w:xz", ".txz": "w:xz"}
#: The mode a finished tarball or checksums.txt takes (less the umask): that of a file
#: created plainly, since a transfer set is for others to read.
_FILE_MODE = 0o666
#: The mode of an exported artifact's file (less the umask): read-only, as the pool's
#: objects are, since a mirror serves the bytes its checksums.txt lists.
_ARTIFACT_MODE = 0o444


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
                          "--manifest M", value=MANIFEST)  # the pool's content, not usage


def check_manifests(artifacts: list[Artifact], read: Callable[[Artifact], bytes]) -> None:
    """Refuse a selection that import would not read back because of an artifact named
    ``<dir>/checksums.txt`` (``read`` gives its bytes). Import reads every such file as
    the checksums of its directory (a FlashInfer pin has one, pinned by its sha256, and
    is exported with it), so it must parse as one, and each name it lists must have the
    sha256 the set's own ``checksums.txt`` and every other such file give it.

    Raises:
        ConfigError: such an artifact is not a checksums file, or contradicts the set
            or another one.
    """
    listed = {a.name: (a.sha256, f"the set's own {MANIFEST}") for a in artifacts}
    for artifact in sorted(artifacts, key=lambda a: a.name):
        if posixpath.basename(artifact.name) != MANIFEST:
            continue
        try:
            text = decode_manifest(read(artifact), source=artifact.name)
            entries = parse_checksums(text, prefix=posixpath.dirname(artifact.name),
                                      source=artifact.name)
        except (ManifestError, ArtifactNameError) as exc:
            raise ConfigError(f"cannot export {artifact.name}: pool import reads every file "
                              f"named {MANIFEST} as the checksums of its directory, and this "
                              f"one is not ({exc}); leave it out with --manifest M",
                              value=artifact.name) from exc  # the pool's content, not usage
        for entry in entries:
            sha, where = listed.setdefault(entry.name, (entry.sha256, artifact.name))
            if sha != entry.sha256:
                raise ConfigError(f"cannot export {artifact.name}: it lists {entry.name} as "
                                  f"{entry.sha256}, but {where} gives {sha}, so pool import "
                                  "would refuse the set; leave one of them out with "
                                  "--manifest M", value=artifact.name)


def _info(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o444
    info.mtime = int(mtime)
    return info


def missing_from(pool: ArtifactPool, artifacts: list[Artifact]) -> list[Artifact]:
    """The artifacts whose object ``pool`` lacks."""
    return [a for a in artifacts if not pool.has(a.sha256)]


def _verified(pool: ArtifactPool, artifact: Artifact) -> bytes:
    """The verified bytes of ``artifact``'s object in ``pool`` (PoolError: it is
    corrupt, and quarantined where it can be moved; or it left the pool meanwhile)."""
    before = pool.quarantined
    data = pool.get(artifact.sha256)
    if data is not None:
        return data
    moved = pool.quarantined > before
    what = (f"is corrupt (it failed verification{' and was moved to quarantine/' if moved else ''})"
            if moved or pool.has(artifact.sha256) else "left the pool while the export ran")
    raise PoolError(f"cannot export {artifact.name}: its object {artifact.sha256} in {pool.root} "
                    f"{what}; fetch it again (distcache fetch --manifest FILE), then export "
                    "again", path=str(pool.root))


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
    """Make ``directory`` hold ``artifacts`` (each read and verified from ``pool``) at
    their names, listed in its ``checksums.txt``, all or nothing.

    ``directory`` may be absent (its parent must exist), empty, or an earlier export
    (a ``checksums.txt`` at its top listing every file under it). The new tree is built
    in a fresh directory beside it (``0700`` until complete): each artifact a copy of
    its verified object, never a link to it, so writing to an exported file cannot
    change the pool; then the earlier export's other artifacts, checked against the
    sha256s it lists; then ``checksums.txt``. Flushed and given the directory's mode,
    it is renamed into place, an earlier export renamed aside first and removed after.
    A failure or an interrupt before then leaves ``directory`` as it was and removes
    the new tree. A symbolic link named as ``directory`` stays; what it points at is
    replaced.

    No label is recorded (unlike :meth:`ArtifactPool.materialize`): exporting another
    set's manifest renames nothing, and a read-only ``names.log`` is no obstacle.

    Raises:
        PoolError: an object is corrupt or gone; ``directory`` holds what no earlier
            export wrote (or its file changed), or it or its parent is no directory; or
            a file cannot be written (nothing is changed in any case).
        ConfigError: an artifact is named ``checksums.txt``, or one named
            ``<dir>/checksums.txt`` would be refused by import (:func:`check_manifests`).
        ArtifactNameError: a name is unsafe.
        IntegrityError: an object's size is not the one its artifact declares.
    """
    check_names(artifacts)
    target = Path(os.path.abspath(directory))
    if target.is_symlink() and target.is_dir():
        target = Path(os.path.realpath(target))
    if (os.path.lexists(target) and not target.is_dir()) or not target.parent.is_dir():
        raise PoolError(f"cannot export to {directory}: it or its parent exists and is not "
                        "a directory", path=str(directory))
    wanted = {a.name: a for a in artifacts}
    inside = built_inside(target)
    earlier = earlier_export(target, wanted if inside else None)
    kept = {n: a for n, a in (earlier or {}).items() if n not in wanted and n != MANIFEST}
    check_manifests([*wanted.values(), *kept.values()],
                    lambda a: _verified(pool, a) if a.name in wanted else carried(target, a))
    new = staging(target, inside)
    try:
        os.mkdir(new, 0o700)
    except OSError as exc:
        raise PoolError(f"cannot export to {target}: cannot create {new} to build it in "
                        f"({exc.strerror or exc}); check that you can write to {target.parent}",
                        path=str(target), errno=exc.errno) from exc
    aside: Path | None = None
    umask = process_umask()
    try:
        for name, artifact in sorted(wanted.items()):
            data = _verified(pool, artifact)
            check_size(artifact, len(data), "pool")
            write_file(new, name, data, _ARTIFACT_MODE & ~umask)
        for name, artifact in sorted(kept.items()):
            write_file(new, name, carried(target, artifact), _ARTIFACT_MODE & ~umask)
        listed = sorted([*wanted.values(), *kept.values()], key=lambda a: a.name)
        write_file(new, MANIFEST, manifest_text(listed).encode("utf-8"), _FILE_MODE & ~umask)
        try:
            flush_tree(new)
            if inside:
                move_into(new, target)
                return
            known = os.stat(target) if os.path.lexists(target) else None
            mode = (stat.S_IMODE(known.st_mode) if known is not None
                    else (0o777 & ~umask) | (os.stat(new).st_mode & stat.S_ISGID))
            os.chmod(new, mode)
            if known is not None:  # the directory's owner too, where this user may
                with contextlib.suppress(OSError):
                    os.chown(new, known.st_uid, known.st_gid)
            if earlier is not None:
                aside = _temp_path(target, "old")
                os.rename(target, aside)
            os.rename(new, target)  # over an empty directory, or where there is none
        except OSError as exc:  # a flush failed, or a rename
            left = ("it may be part-way: export the same artifacts again to complete it"
                    if inside else "it was left as it was")
            raise PoolError(f"cannot export to {target}: cannot put the new export in place "
                            f"({exc.strerror or exc}); {left}",
                            path=str(target), errno=exc.errno) from exc
    except BaseException:
        undo(new, target, aside)
        raise
    with contextlib.suppress(PoolError):  # in place and flushed; only its entry may lag
        fsync_dir(target.parent)
    if aside is not None:
        remove_tree(aside)


def export_tar(pool: ArtifactPool, artifacts: list[Artifact], target: Path,
               progress: Progress | None = None) -> ExportReport:
    """Write ``artifacts`` (each read and verified from ``pool``) and their
    ``checksums.txt`` into the tarball ``target``, atomically.

    Raises:
        PoolError: an artifact is missing from the pool or corrupt there, the
            target's directory does not exist, the target is a directory, or the
            temporary file beside the target cannot be created (nothing is written in
            any case).
        ConfigError: the target's suffix is not one import reads back, an artifact
            is named ``checksums.txt``, or one named ``<dir>/checksums.txt`` would be
            refused by import (nothing is written in any case).
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
    check_manifests(artifacts, lambda a: _verified(pool, a))
    target = target.absolute()
    if target.is_symlink():  # the file it points at is the tarball, as tar -cf has it
        target = Path(os.path.realpath(target))
    if not target.parent.is_dir():
        raise PoolError(f"cannot export to {target}: {target.parent} is not a directory",
                        path=str(target))
    if target.is_dir():  # refused before a byte is written, not at the rename
        raise PoolError(f"cannot export to {target}: it is a directory; give the tarball a "
                        "name of its own, or export into the directory with 'pool export "
                        "DIR' (no --tar)", path=str(target))
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
                    data = _verified(pool, artifact)
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
    with contextlib.suppress(PoolError):  # in place and flushed; only its entry may lag
        fsync_dir(target.parent)
    return ExportReport(target=str(target), artifacts=len(artifacts), bytes=total)
