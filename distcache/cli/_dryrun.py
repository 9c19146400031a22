"""``distcache prefetch --dry-run``: what this process's pool lacks of what a prefetch
would fetch, without contacting an origin or any other rank.

Not collective: it reads the manifests, the usage record as this node sees it (as its
files are: they are not compacted, as a prefetch's read does), and the families'
pinned ``checksums.txt`` from the pool, and compares them with the pool.
A family whose ``checksums.txt`` is not in the pool yet cannot be expanded offline:
the manifest itself is listed as missing, and the family is reported as not expanded.
Run it once per pool (one process per node, or under the launcher, where each rank
reports the pool it uses). A pool that does not exist is reported as lacking
everything and is not created; one that does is opened read-only, and nothing there
changes.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from distcache.artifact import Artifact, merge_manifests, read_manifest
from distcache.cli._common import EXIT_OK, emit, human_bytes, pool_root
from distcache.errors import ConfigError
from distcache.integrations.flashinfer import family_checksums
from distcache.integrations.flashinfer._record import read_record
from distcache.integrations.flashinfer._warm import _parse_family, arch_filter
from distcache.store import ArtifactPool, PoolLayout


def _families(pool: ArtifactPool | None, families: list[str],
              keep: Callable[[str], bool]) -> tuple[list[Artifact], list[str]]:
    """Every artifact of ``families`` the pool can tell, and the families it cannot."""
    listed: list[Artifact] = []
    unexpanded: list[str] = []
    for family in families:
        checksums = family_checksums(family)
        listed.append(checksums)
        data = pool.get(checksums.sha256) if pool is not None else None
        if data is None:
            unexpanded.append(family)
            continue
        listed += [a for a in _parse_family(checksums, data) if keep(a.name)]
    return listed, unexpanded


def _recorded(record: str | None) -> list[Artifact]:
    """What the usage record in ``record`` lists (empty without one), read as its files
    are: unlike a prefetch's read, this host's finished files are not merged and
    removed, and no lock file is made there."""
    found = {} if record is None else read_record(record, compact=False)
    return [Artifact(name, sha) for name, sha in sorted(found.items())]


def run_dry_run(args: argparse.Namespace) -> int:
    """Print what the pool lacks: names as text, or one JSON document."""
    root = pool_root(args)
    made = PoolLayout(root).is_pool(made_by_distcache=True)
    pool = ArtifactPool(root, read_only=True) if made else None
    if args.flashinfer and args.record and not Path(args.record).is_dir():
        # A typo would otherwise list nothing and succeed.
        raise ConfigError(f"--record {args.record}: no such directory on this machine; "
                          "pass the directory the engine's runs recorded into (the "
                          "FlashInfer integration's record=...)",
                          variable="--record", value=args.record)
    keep = arch_filter(args.arch)
    parts: list[tuple[str, list[Artifact]]] = []
    for path in args.manifest or ():
        parts.append((path, read_manifest(path)))
    unexpanded: list[str] = []
    if args.flashinfer:
        parts.append(("usage record", _recorded(args.record)))
        listed, unexpanded = _families(pool, args.family, keep)
        parts.append(("families", listed))
    wanted = merge_manifests(parts)
    missing = [a for a in wanted if pool is None or not pool.has(a.sha256)]
    known = [a.size for a in missing if a.size is not None]
    missing_bytes = sum(known) if len(known) == len(missing) else None
    data = {
        "root": root, "exists": pool is not None, "artifacts": len(wanted),
        "missing": [{"name": a.name, "sha256": a.sha256} for a in missing],
        "missing_bytes": missing_bytes,
        "families_not_expanded": unexpanded, "archs": list(args.arch),
    }
    size = f", {human_bytes(missing_bytes)}" if known and missing_bytes is not None else ""
    lines = [f"{root}{'' if pool is not None else ' (no pool yet)'} lacks {len(missing)} of "
             f"{len(wanted)} artifacts{size}"]
    lines += [f"  {a.sha256}  {a.name}" for a in missing]
    lines += [f"  family {f}: its checksums.txt is not in the pool, so its files are not "
              "listed; a prefetch fetches it first" for f in unexpanded]
    emit(args, data, lines)
    return EXIT_OK
