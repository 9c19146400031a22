"""``distcache pool import DIR`` and ``pool export DIR``: move artifacts between a
pool and a plain directory (a mirror laid out as ``DIR/<name>`` plus ``checksums.txt``,
the same layout a :class:`~distcache.origins.DirOrigin` reads)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from distcache._resolve import resolve_pool
from distcache.artifact import Artifact, manifest_text, read_manifest, sha256_hex
from distcache.cli._common import EXIT_ERROR, EXIT_OK, UsageError, human_bytes
from distcache.config import settings
from distcache.errors import DistcacheError
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool


def _files_under(directory: Path) -> list[str]:
    names = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        for filename in sorted(filenames):
            path = Path(dirpath, filename)
            if path.is_symlink() or not path.is_file():
                continue
            names.append(path.relative_to(directory).as_posix())
    return names


def _import_checked(pool: ArtifactPool, source: Path, manifest: Path,
                    imported: list[Artifact], failures: list[str]) -> tuple[int, int]:
    """Import what ``manifest`` lists, each verified; returns ``(new objects, bytes)``."""
    mirror = DirOrigin(source)
    new = nbytes = 0
    for artifact in read_manifest(manifest):
        try:
            data = mirror.fetch(artifact)
        except DistcacheError as exc:
            failures.append(exc.message)
            continue
        new += not pool.has(artifact.sha256)
        pool.put(data, artifact.sha256)
        imported.append(artifact)
        nbytes += len(data)
    return new, nbytes


def _import_loose(pool: ArtifactPool, source: Path,
                  imported: list[Artifact]) -> tuple[int, int]:
    """Import every regular file under ``source``, named by its relative path."""
    new = nbytes = 0
    for name in _files_under(source):
        data = (source / name).read_bytes()
        sha = sha256_hex(data)
        new += not pool.has(sha)
        pool.put(data, sha)
        imported.append(Artifact(name, sha, len(data)))
        nbytes += len(data)
    return new, nbytes


def run_import(args: argparse.Namespace) -> int:
    """``pool import DIR``: add a directory's files (verified against its
    ``checksums.txt`` when there is one); exit 1 if any listed file did not match."""
    source: Path = args.directory
    if not source.is_dir():
        raise UsageError(f"import: {source} is not a directory")
    pool = resolve_pool(args.pool, settings())
    manifest = source / "checksums.txt"
    checked = manifest.is_file()
    failures: list[str] = []
    imported: list[Artifact] = []
    if checked:
        new, nbytes = _import_checked(pool, source, manifest, imported, failures)
    else:
        new, nbytes = _import_loose(pool, source, imported)
    pool.remember(imported)
    note = " (checked against checksums.txt)" if checked else ""
    print(f"imported {len(imported)} artifacts ({human_bytes(nbytes)}, {new} new objects) from "
          f"{source}{note} into {pool.root}")
    for message in failures:
        print(f"distcache: not imported: {message}", file=sys.stderr)
    return EXIT_ERROR if failures else EXIT_OK


def run_export(args: argparse.Namespace) -> int:
    """``pool export DIR``: every named artifact present, plus ``checksums.txt``
    (merged with one already there), written atomically."""
    pool = resolve_pool(args.pool, settings(), must_exist=True)
    target: Path = args.directory
    target.mkdir(parents=True, exist_ok=True)
    manifest = target / "checksums.txt"
    listed = {a.name: a for a in read_manifest(manifest)} if manifest.is_file() else {}
    exported = 0
    for name, sha in sorted(pool.names().items()):
        if not pool.has(sha):
            continue
        artifact = Artifact(name, sha)
        pool.materialize(artifact, target)
        listed[name] = artifact
        exported += 1
    tmp = target / f".checksums.txt.{os.getpid()}"
    tmp.write_text(manifest_text(sorted(listed.values(), key=lambda a: a.name)), encoding="utf-8")
    os.replace(tmp, manifest)
    print(f"exported {exported} artifacts and checksums.txt to {target}")
    return EXIT_OK
