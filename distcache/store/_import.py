"""Import an artifact set into a pool: a ``flashinfer-cubin`` wheel, a tarball (such as
``distcache pool export --tar`` writes) or a directory.

Names. A wheel keeps FlashInfer's artifacts under ``flashinfer_cubin/cubins/``, laid
out exactly as FlashInfer's loader asks for them (``get_artifact(<pin>/<path>)``,
e.g. ``158f.../fmha/trtllm-gen/fmhaSm100aKernel_....cubin``). When a source has that
directory at its top, or every member lies in one top folder that has it (a wheel
unpacked into a folder, then packed), it is the root and everything outside it (the
package's code, its ``.dist-info``) is ignored; otherwise the root is the source's top.
A ``checksums.txt`` at the top, or at the top of that one folder, marks an exported
set, never a wheel: its root is the top whatever its names hold, and a name
such as ``vendor/flashinfer_cubin/cubins/k.cubin`` is kept whole. Each artifact is
labelled with its path under the root, so the integration's lookups hit.

Verification. Every ``checksums.txt`` under the root lists files relative to its own
directory (one per pin in a wheel; one at the top of an exported set). Every file a
manifest lists is hashed and must match; a ``checksums.txt`` file itself is labelled
too (FlashInfer asks for it, pinned by its own sha256), except the one at the root,
which describes the set. Files that no manifest lists are skipped, unless the source
has no ``checksums.txt`` at all, where every file is imported under its path. Files a
pin's manifest lists but the source lacks (a wheel ships some pins' manifests without
their files) are counted and reported, not an error; a file the root ``checksums.txt``
lists but the source lacks (an exported set cut short) refuses the import.

All or nothing. The first pass reads every member, checks it (see
:mod:`distcache.store._sources`) and hashes it in chunks, keeping only the manifests
(together at most ``MAX_MANIFEST_BYTES``, as a manifest read from a file: a few
compressed megabytes could otherwise hold gigabytes of them in memory); a source
with no file at all (an empty directory or archive, or a tarball of zeros, which
reads as one) is refused as nothing to import. Any unsafe or oversized member, an
unreadable archive, conflicting manifests, a file
missing from the root manifest or a single sha256 mismatch refuses the whole import
before anything is written. The second pass publishes the objects, then records the
labels in one append, only once every planned object is in the pool: a source that
changed between the passes (a member gone, or different bytes) fails the import with
no label recorded. A failure during the second pass (a full disk) leaves some objects
without labels: invisible to lookups by name, and collected by ``pool gc`` like any
other.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from distcache.artifact import MAX_MANIFEST_BYTES, Artifact, decode_manifest, parse_checksums
from distcache.config import settings
from distcache.errors import (
    ArtifactNameError,
    ConfigError,
    IntegrityError,
    ManifestError,
    PoolError,
)
from distcache.store._pool import ArtifactPool
from distcache.store._sources import kind_of, members, refuse, total_bytes

#: Where a ``flashinfer-cubin`` wheel keeps FlashInfer's artifact tree.
WHEEL_ROOT = "flashinfer_cubin/cubins/"
MANIFEST = "checksums.txt"
_SHOWN_MISMATCHES = 5


class Progress(Protocol):
    """Told how far an import or export has come (the CLI draws a bar on a terminal)."""

    def phase(self, label: str, total_bytes: int | None) -> None: ...

    def advance(self, nbytes: int) -> None: ...


@dataclass
class ImportReport:
    """What :func:`import_set` did."""

    source: str
    kind: str
    artifacts: int = 0  #: labels recorded
    bytes: int = 0  #: bytes of the labelled artifacts
    new_objects: int = 0  #: objects that were not in the pool before
    manifests: int = 0  #: ``checksums.txt`` files read
    verified: int = 0  #: files checked against a manifest
    unlisted: int = 0  #: files under the root no manifest lists (skipped)
    absent: int = 0  #: files a manifest lists that the source lacks (not imported)
    ignored: int = 0  #: files outside the root (a wheel's code and metadata)
    filtered: int = 0  #: verified files left out by the caller's filter (``--arch``)
    absent_examples: list[str] = field(default_factory=list)


@dataclass
class _Scan:
    root: str = ""
    files: dict[str, tuple[str, int]] = field(default_factory=dict)  # rel -> (sha, size)
    manifests: dict[str, bytes] = field(default_factory=dict)  # rel -> text
    ignored: int = 0


def _root_of(path: str, root: str) -> str | None:
    if not root:
        return path
    return path[len(root):] if path.startswith(root) else None


def _is_manifest(path: str) -> bool:
    return posixpath.basename(path) == MANIFEST


def _wheel_root(paths: Collection[str]) -> str:
    """The root of the set whose member paths are ``paths``: a wheel's artifact
    directory, where it is at the top or in the one folder every member is in (and no
    ``checksums.txt`` is beside it), else the top (``""``)."""
    tops = {path.split("/", 1)[0] if "/" in path else None for path in paths}
    folders = [""]
    if len(tops) == 1 and None not in tops:
        folders.append(f"{tops.pop()}/")
    for folder in folders:
        root = folder + WHEEL_ROOT
        if folder + MANIFEST not in paths and any(p.startswith(root) for p in paths):
            return root
    return ""


def _scan(source: Path, kind: str, progress: Progress | None, max_bytes: int) -> _Scan:
    # Every member is hashed, and every checksums.txt kept, before the root is known:
    # whether a set is a wheel depends on members anywhere in it.
    found: dict[str, tuple[str, int]] = {}
    texts: dict[str, bytes] = {}
    if progress is not None:
        progress.phase("verifying", total_bytes(source, kind))
    for path, size, sha, data in members(source, kind, want=_is_manifest, digest=True,
                                         max_bytes=max_bytes, max_kept=MAX_MANIFEST_BYTES):
        assert sha is not None  # every member is hashed
        found[path] = (sha, size)
        if data is not None:
            texts[path] = data
        if progress is not None:
            progress.advance(size)
    if not found:
        raise refuse(source, "it holds no file (an empty directory or archive; a file of "
                             "zeros reads as an empty tarball): check that it was copied "
                             "whole")
    scan = _Scan(root=_wheel_root(found))
    for path, entry in found.items():
        rel = _root_of(path, scan.root)
        if rel is None:
            scan.ignored += 1
            continue
        scan.files[rel] = entry
        if path in texts:
            scan.manifests[rel] = texts[path]
    return scan


def _expected(source: Path, scan: _Scan) -> tuple[dict[str, str], set[str]]:
    # Every listed name and its sha256, and the names the root manifest lists.
    expected: dict[str, str] = {}
    at_root: set[str] = set()
    for rel, data in sorted(scan.manifests.items()):
        directory = posixpath.dirname(rel)
        try:
            listed = parse_checksums(decode_manifest(data, source=rel), prefix=directory)
        except (ManifestError, ArtifactNameError) as exc:
            raise refuse(source, f"{rel} is malformed: {exc}") from exc
        for artifact in listed:
            other = expected.setdefault(artifact.name, artifact.sha256)
            if other != artifact.sha256:
                raise refuse(source, f"manifests disagree on {artifact.name}: {other} and "
                                     f"{artifact.sha256} (in {rel})")
            if rel == MANIFEST:
                at_root.add(artifact.name)
    return expected, at_root


def _a_pools_own(files: Collection[str]) -> bool:
    """Whether ``files`` are a pool's own (at the top or in one directory): its
    ``format`` or ``pool_id`` beside objects stored under their digests
    (``objects/<xx>/<sha256>``)."""
    tops = {rel[: len(rel) - len(name)] for rel in files for name in ("format", "pool_id")
            if rel == name or rel.endswith(f"/{name}")}
    return any(len(rel) == len(top) + 75 and rel.startswith(f"{top}objects/")
               and rel[len(top) + 10] == "/" and rel[len(top) + 8:len(top) + 10]
               == rel[len(top) + 11:len(top) + 13] for top in tops for rel in files)


def plan_import(source: Path, scan: _Scan, kind: str,
                keep: Callable[[str], bool] | None = None) -> tuple[list[Artifact], ImportReport]:
    """The labels to record (every one verified, and wanted by ``keep``) and the
    report, from a scan.

    Raises:
        IntegrityError: a listed file does not match its sha256 (nothing is imported).
        ConfigError: a malformed or conflicting manifest, or a file the root
            ``checksums.txt`` lists is not in the source.
    """
    if _a_pools_own(scan.files):
        # Its files are the pool's internals, not artifacts: their names would be lost.
        raise refuse(source, "it is an archive of a distcache pool, not an artifact set; "
                             "write one with 'distcache --pool POOL pool export --tar FILE' "
                             "and import FILE")
    expected, at_root = _expected(source, scan)
    loose = not scan.manifests
    report = ImportReport(source=str(source), kind=kind, manifests=len(scan.manifests),
                          ignored=scan.ignored)
    labels: list[Artifact] = []
    mismatches: list[str] = []
    for rel, (sha, size) in sorted(scan.files.items()):
        if rel == MANIFEST:
            continue
        want = expected.get(rel)
        if want is not None:
            report.verified += 1
            if want != sha:
                mismatches.append(f"{rel}: checksums.txt says {want}, the file hashes to {sha}")
                continue
        elif not (loose or posixpath.basename(rel) == MANIFEST):
            report.unlisted += 1
            continue
        if keep is not None and not keep(rel):
            report.filtered += 1
            continue
        labels.append(Artifact(rel, sha, size))
        report.bytes += size
    if mismatches:
        shown = "; ".join(mismatches[:_SHOWN_MISMATCHES])
        more = len(mismatches) - _SHOWN_MISMATCHES
        raise IntegrityError(
            f"cannot import {source}: sha256 mismatch for {len(mismatches)} file(s): {shown}"
            f"{f'; and {more} more' if more > 0 else ''}; nothing was imported",
            source=str(source), name=mismatches[0].split(":", 1)[0],
        )
    cut = sorted(at_root - set(scan.files))
    if cut:
        raise refuse(source, f"{len(cut)} file(s) its checksums.txt lists are not in it "
                             f"(e.g. {', '.join(cut[:3])}): it is cut short or incomplete")
    missing = sorted(set(expected) - set(scan.files))
    report.absent = len(missing)
    report.absent_examples = missing[:3]
    report.artifacts = len(labels)
    return labels, report


def import_set(pool: ArtifactPool, source: Path, progress: Progress | None = None,
               keep: Callable[[str], bool] | None = None,
               max_bytes: int | None = None) -> ImportReport:
    """Import a wheel, tarball or directory into ``pool``, all or nothing (see the
    module docstring). ``keep`` selects among the verified files by name (every file
    is still verified). A member larger than ``max_bytes`` (by default
    ``DISTCACHE_MAX_ARTIFACT_BYTES``) refuses the import before it is read.

    Raises:
        ConfigError: the source is missing, of an unknown kind, unreadable or empty,
            or has an unsafe or oversized member, manifests larger together than
            ``MAX_MANIFEST_BYTES``, a malformed or conflicting manifest, or lacks a
            file its root manifest lists; or it lost a file between the passes.
        IntegrityError: a file does not match its ``checksums.txt``, or changed
            between the passes.
        PoolError: the pool cannot be written.
    """
    if max_bytes is None:
        max_bytes = settings().max_artifact_bytes
    kind = kind_of(source)
    scan = _scan(source, kind, progress, max_bytes)
    labels, report = plan_import(source, scan, kind, keep)
    wanted = {scan.root + a.name: a for a in labels}
    if progress is not None:
        progress.phase("importing", report.bytes)
    publish: Callable[[str], bool] = wanted.__contains__
    # One flush for the whole set rather than an fsync per object; the labels are
    # recorded only once the objects are durable.
    published: set[str] = set()
    with pool.batch():
        for path, size, _sha, data in members(source, kind, want=publish,
                                              max_bytes=max_bytes):
            artifact = wanted.get(path)
            if artifact is None or data is None:
                continue
            report.new_objects += not pool.has(artifact.sha256)
            # put() hashes again: a source changed since the first pass is refused here.
            pool.put(data, artifact.sha256)
            published.add(path)
            if progress is not None:
                progress.advance(size)
    gone = sorted(set(wanted) - published)
    if gone:
        raise ConfigError(f"cannot import {source}: it changed while being imported "
                          f"({len(gone)} verified file(s) are gone, e.g. {gone[0]}); no "
                          "names were recorded", variable="SRC", value=str(source))
    # Another process may have collected objects since they were published (a pool gc
    # to a small cap): their names would list what the pool no longer holds.
    lost = sorted({a.sha256 for a in labels if not pool.has(a.sha256)})
    if lost:
        raise PoolError(f"cannot finish importing {source}: {len(lost)} of its objects were "
                        f"removed from the pool at {pool.root} while it ran (another "
                        f"process's gc or size cap), e.g. {lost[0]}; no names were recorded: "
                        "run the import again", path=str(pool.root))
    pool.remember(labels)
    return report
