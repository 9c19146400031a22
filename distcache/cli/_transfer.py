"""``distcache pool import SRC`` and ``pool export DIR | --tar FILE``: move artifact
sets between a pool and a wheel, a tarball or a plain directory (a mirror laid out as
``DIR/<name>`` plus ``checksums.txt``, the layout a
:class:`~distcache.origins.DirOrigin` reads).

What import accepts, how it names and verifies, and why it is all or nothing:
:mod:`distcache.store._import`. How both exports write, all or nothing and as copies
that leave the pool's objects and labels as they were: :mod:`distcache.store._export`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path

from distcache._argtypes import path
from distcache._resolve import resolve_pool
from distcache.artifact import Artifact, merge_manifests, read_manifest
from distcache.cli._common import (
    EXIT_OK,
    UsageError,
    check_families,
    emit,
    existing_pool,
    human_bytes,
    pool_root,
    progress_bar,
    refuse_foreign,
)
from distcache.config import settings
from distcache.errors import PoolError
from distcache.integrations.flashinfer._warm import ARCH_RULE, arch_filter
from distcache.store import ArtifactPool, PoolLayout
from distcache.store._export import check_names, export_directory, export_tar, missing_from
from distcache.store._import import import_set
from distcache.store._sources import kind_of

IMPORT_HELP = """\
Import a flashinfer-cubin wheel (.whl), a tarball (.tar, .tar.gz, .tgz; e.g. one
written by 'pool export --tar') or a directory into the pool.

Names: a wheel's flashinfer_cubin/cubins/ tree is the root (its Python files and
.dist-info are ignored); otherwise the top of the tarball or directory is. Each file is
labelled with its path under the root, which is the name FlashInfer's loader asks for
(<pin>/<path>). FlashInfer asks by name and sha256 and the pool stores by content, so
a wheel of one FlashInfer version also serves every kernel another version left
unchanged, and such a kernel is stored once.

Verification: every checksums.txt under the root (one per pin in a wheel) lists files
relative to its directory; each listed file must match its sha256. Files no manifest
lists are skipped, unless the source has no checksums.txt at all. Files a pin's
checksums.txt lists but the source lacks are reported, not imported; a file the
checksums.txt at the top lists but the source lacks refuses the import.

All or nothing: an unsafe member (absolute path, '..', symlink, hard link, device),
an unreadable, truncated or damaged archive, one with no file at all (a file of
zeros reads as an empty tarball), a member larger than DISTCACHE_MAX_ARTIFACT_BYTES,
checksums.txt files over 256 MiB together, conflicting manifests or a single sha256
mismatch refuses the whole import (exit 1) and nothing is added to the pool. A failure or an
interrupt (Ctrl-C) while the objects are being added records no name: the objects
already added stay without one (no lookup finds them; pool gc and pool prune remove
them as any other). SRC must be a regular file or a directory (it is read twice; a
pipe cannot be).

With --arch: """ + ARCH_RULE + "\n"


def setup_import(parser: argparse.ArgumentParser) -> None:
    """Add the ``pool import`` arguments."""
    parser.add_argument("source", type=path, metavar="SRC",
                        help="a .whl, a tarball or a directory")
    parser.add_argument("--arch", action="append", default=[], metavar="SM",
                        help="import only what GPUs of this architecture can load, e.g. "
                             "sm_90 or sm_100 (repeatable; the rule is above)")
    parser.set_defaults(run=run_import)


def setup_export(parser: argparse.ArgumentParser) -> None:
    """Add the ``pool export`` arguments."""
    parser.add_argument("directory", type=path, metavar="DIR", nargs="?",
                        help="write every named artifact and checksums.txt under DIR, as "
                             "copies, all or nothing; DIR must be new, empty or an earlier "
                             "export (whose other artifacts stay)")
    parser.add_argument("--tar", type=path, metavar="FILE",
                        help="write one tarball instead (.tar, .tar.gz/.tgz, .tar.bz2/.tbz2, "
                             ".tar.xz/.txz; the suffix picks the compression), atomically; "
                             "'pool import FILE' reads it back")
    parser.add_argument("--manifest", type=path, action="append", metavar="M",
                        help="export only the artifacts this checksums.txt lists (all "
                             "must be in the pool; repeatable: their union)")
    parser.add_argument("--family", action="append", default=[], metavar="NAME",
                        help="export only this JIT cache family's trees and files, e.g. "
                             "inductor (repeatable); without it they go with the rest")
    parser.set_defaults(run=run_export)


def run_import(args: argparse.Namespace) -> int:
    """``pool import SRC``: all or nothing; exit 1 (one line on stderr) if refused."""
    keep = arch_filter(args.arch) if args.arch else None
    if PoolLayout(args.source).is_pool(made_by_distcache=True):
        # Its files are the pool's internals, not artifacts: their names would be lost.
        raise PoolError(f"cannot import {args.source}: it is a distcache pool, not an "
                        "artifact set; write one with 'distcache --pool "
                        f"{args.source} pool export --tar FILE' and import FILE",
                        path=str(args.source))
    root = pool_root(args)
    refuse_foreign(root)
    # Before the pool is opened, which creates it: a mistyped SRC leaves no pool.
    kind_of(args.source)
    if Path(args.source).is_dir() and Path(root).resolve().is_relative_to(
            Path(args.source).resolve()):
        # Its files would be taken for artifacts, and the next import for a pool's.
        raise PoolError(f"cannot import {args.source}: the pool {root} is inside it; keep "
                        "the pool outside the directory you import (--pool or "
                        "DISTCACHE_POOL)", path=str(args.source))
    pool = resolve_pool(root, settings())
    bar = progress_bar(args)
    try:
        report = import_set(pool, args.source, bar, keep)
    finally:
        if bar is not None:
            bar.close()
    notes = []
    if report.manifests:
        notes.append(f"{report.verified} checked against {report.manifests} checksums.txt")
    else:
        notes.append("no checksums.txt: imported unchecked, hashed on the way in")
    if report.filtered:
        notes.append(f"{report.filtered} files for other architectures left out "
                     f"(--arch {' '.join(args.arch)})")
    if report.unlisted:
        notes.append(f"{report.unlisted} files listed in no checksums.txt skipped")
    if report.absent:
        notes.append(f"{report.absent} listed files not in the source "
                     f"(e.g. {report.absent_examples[0]})")
    data = {"root": pool.root, **dataclasses.asdict(report)}
    emit(args, data, [
        f"imported {report.artifacts} artifacts ({human_bytes(report.bytes)}, "
        f"{report.new_objects} new objects) from {args.source} into {pool.root}",
        *(f"  {note}" for note in notes)])
    return EXIT_OK


def _selection(pool: ArtifactPool, manifests: list[Path] | None) -> list[Artifact]:
    if manifests:
        return merge_manifests([(str(m), read_manifest(m)) for m in manifests])
    return [Artifact(name, sha) for name, sha in sorted(pool.names().items()) if pool.has(sha)]


def run_export(args: argparse.Namespace) -> int:
    """``pool export DIR`` or ``pool export --tar FILE``."""
    if (args.directory is None) == (args.tar is None):
        raise UsageError("export: give either DIR or --tar FILE")
    if args.family and args.manifest is not None:
        raise UsageError("export: give either --manifest or --family")
    if args.family:  # a misspelt family is bad usage, whatever the pool
        check_families(args.family)
    pool = existing_pool(args)
    if args.family:
        from distcache.jit import family_labels

        artifacts = family_labels(pool, tuple(args.family))
    else:
        artifacts = _selection(pool, args.manifest)
    if args.tar is not None:
        # Before anything is written: the pool's tmp/ sweep would remove a tarball
        # there, and one under objects/ would be taken for a corrupt object.
        _refuse_inside(pool, args.tar, "a file")
        bar = progress_bar(args)
        try:
            report = export_tar(pool, artifacts, args.tar, bar)
        finally:
            if bar is not None:
                bar.close()
        emit(args, {"root": pool.root, **dataclasses.asdict(report)}, [
            f"exported {report.artifacts} artifacts ({human_bytes(report.bytes)}) and "
            f"checksums.txt to {report.target}"])
        return EXIT_OK
    check_names(artifacts)
    absent = missing_from(pool, artifacts)
    if absent:
        # Checked before DIR is made: a refused export writes nothing.
        raise PoolError(f"cannot export: {len(absent)} artifact(s) are not in pool "
                        f"{pool.root}: {', '.join(a.name for a in absent[:5])}; fetch them "
                        "first (distcache fetch --manifest FILE)", path=str(pool.root))
    target: Path = args.directory
    _refuse_inside(pool, target, "a directory")
    made = _make_parents(target)
    try:
        export_directory(pool, artifacts, target)
    except BaseException:
        for directory in reversed(made):  # only the empty parents this export made
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    emit(args, {"root": pool.root, "target": target, "artifacts": len(artifacts)},
         [f"exported {len(artifacts)} artifacts and checksums.txt to {target}"])
    return EXIT_OK


def _refuse_inside(pool: ArtifactPool, target: Path, what: str) -> None:
    """Refuse an export target (``what`` it is to be) that is the pool or inside it.

    Raises:
        PoolError: it is.
    """
    if target.resolve().is_relative_to(pool.root.resolve()):
        raise PoolError(f"cannot export to {target}: it is inside the pool at {pool.root}; "
                        f"export to {what} outside it", path=str(target))


def _make_parents(target: Path) -> list[Path]:
    """Create the missing parents of the export directory ``target`` (the export
    creates ``target`` itself); the directories made, outermost first.

    Raises:
        PoolError: ``target`` or a parent exists and is not a directory, or a parent
            cannot be created.
    """
    blocker = next((p for p in (target, *target.parents)
                    if (p.exists() or p.is_symlink()) and not p.is_dir()), None)
    if blocker is not None:
        raise PoolError(f"cannot export to {target}: {blocker} exists and is not a "
                        "directory; give a directory that is new, empty or an earlier "
                        "export, or --tar FILE to write one tarball", path=str(target))
    made: list[Path] = []
    try:
        for parent in reversed(target.parents):
            if not parent.is_dir():
                try:
                    parent.mkdir()
                except FileExistsError:
                    if parent.is_dir():
                        continue  # another process made it: not this export's to remove
                    raise
                made.append(parent)
    except OSError as exc:
        for directory in reversed(made):
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise PoolError(f"cannot export to {target}: the directory cannot be created "
                        f"({exc.strerror or exc}); check the permissions of its parent, or "
                        "give another directory", path=str(target), errno=exc.errno) from None
    return made
