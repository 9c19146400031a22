"""``distcache pool ls|stats|verify|gc|import|export|rm|prune``: inspect and maintain a
pool.

The inspecting actions never create a pool (a missing one is an error); ``import``
creates it. ``import`` and ``export`` live in :mod:`distcache.cli._transfer`, ``rm``
and ``prune`` in :mod:`distcache.cli._hygiene`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator

from distcache.cli._common import (
    EXIT_CORRUPT,
    EXIT_OK,
    add_json_option,
    check_families,
    common_options,
    emit,
    existing_pool,
    human_bytes,
)
from distcache.cli._fetch import say
from distcache.cli._hygiene import PRUNE_HELP, RM_HELP, setup_prune, setup_rm
from distcache.cli._transfer import IMPORT_HELP, setup_export, setup_import
from distcache.config import parse_bytes
from distcache.errors import PoolError
from distcache.store import ArtifactPool


def setup_pool(parser: argparse.ArgumentParser) -> None:
    """Add the pool actions to the ``pool`` subcommand's parser."""
    subparsers = parser.add_subparsers(dest="pool_command", metavar="ACTION", required=True)

    def action(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=help, parents=[common_options()],
                                     description=description or help,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    ls = action("ls", "list named artifacts present in the pool (sha256sum format)")
    ls.add_argument("--family", nargs="?", const="", default=None, metavar="NAME",
                    help="list the JIT cache families instead (or only NAME, e.g. "
                         "inductor): one line per family and key")
    add_json_option(ls)
    ls.set_defaults(run=run_ls)
    stats = action("stats", "object count, bytes, quarantine, cap")
    add_json_option(stats)
    stats.set_defaults(run=run_stats)
    verify = action("verify", "hash every object; quarantine corrupt ones (exit 3 if any)")
    add_json_option(verify)
    verify.set_defaults(run=run_verify)
    gc = action("gc", "remove least recently used objects down to a cap")
    gc.add_argument("--max-bytes", metavar="SIZE",
                    help="cap, e.g. 20G (default: DISTCACHE_POOL_MAX_BYTES)")
    add_json_option(gc)
    gc.set_defaults(run=run_gc)
    imp = action("import", "add a flashinfer-cubin wheel, a tarball or a directory, "
                           "verified, all or nothing", IMPORT_HELP)
    setup_import(imp)
    add_json_option(imp)
    exp = action("export", "write the named artifacts and checksums.txt under DIR, or "
                           "into one tarball (--tar) for an air-gapped transfer")
    setup_export(exp)
    add_json_option(exp)
    setup_rm(action("rm", "remove labels by name or glob, and the objects only they use",
                    RM_HELP))
    setup_prune(action("prune", "remove objects unused for a duration, and their labels",
                       PRUNE_HELP))


def run_ls(args: argparse.Namespace) -> int:
    """``pool ls``: each named artifact whose object is present, as ``sha  name``."""
    if args.family:  # a misspelt family is bad usage, whatever the pool
        check_families([args.family])
    pool = existing_pool(args)
    if args.family is not None:
        return _ls_families(args, pool)
    # One listing of objects/, which fails where it cannot be listed (pool stats and
    # verify say so too), rather than a look per name that takes the error for absence.
    held = set(pool.objects())
    present = [(name, sha) for name, sha in sorted(pool.names().items()) if sha in held]
    data = {"root": pool.root,
            "artifacts": [{"name": name, "sha256": sha} for name, sha in present]}
    emit(args, data, (f"{sha}  {name}" for name, sha in present))
    return EXIT_OK


def _ls_families(args: argparse.Namespace, pool: ArtifactPool) -> int:
    """``pool ls --family [NAME]``: each family and key the pool holds trees for."""
    from distcache.jit import summarize

    found = summarize(pool, (args.family,) if args.family else ())
    data = {"root": pool.root, "families": [dataclasses.asdict(f) for f in found]}
    emit(args, data, (
        f"{f.family}  {f.key_id}  {f.files} files ({human_bytes(f.bytes)}) in {f.trees} "
        f"tree(s)" + (f", {f.conflicts} conflicting" if f.conflicts else "")
        + (f", {f.absent} absent" if f.absent else "") + f"  {f.key}" for f in found))
    return EXIT_OK


def _stats_lines(fields: dict[str, object]) -> Iterator[str]:
    for key, value in fields.items():
        shown = value
        if key in ("bytes", "max_bytes") and (value is None or isinstance(value, int)):
            shown = human_bytes(value) if value is None else (
                f"{value} ({human_bytes(value)})")
        yield f"{key}: {shown}"


def run_stats(args: argparse.Namespace) -> int:
    """``pool stats``: one ``key: value`` line per field of :class:`PoolStats`."""
    stats = existing_pool(args).stats()
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    emit(args, fields, _stats_lines(fields))
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    """``pool verify``: hash every object; exit 3 when any was corrupt."""
    pool = existing_pool(args)
    report = pool.verify()
    data = {"root": pool.root, **dataclasses.asdict(report)}
    emit(args, data, [
        f"verified {report.ok + report.corrupt} objects in {pool.root}: {report.ok} ok "
        f"({human_bytes(report.ok_bytes)}), {report.corrupt} corrupt, "
        f"{report.quarantined} in quarantine"])
    if report.moved:
        say(f"distcache: {report.moved} corrupt object(s) moved to "
            f"{pool.root / 'quarantine'}; they will be fetched again when needed")
    if report.corrupt > report.moved:
        cause = ("the pool is not writable" if not os.access(pool.layout.objects, os.W_OK)
                 else "see the errors above")
        say(f"distcache: {report.corrupt - report.moved} corrupt object(s) could not be "
            f"moved to {pool.root / 'quarantine'} ({cause}) and are still in place; "
            "readers treat them as misses")
    if report.corrupt:
        return EXIT_CORRUPT
    return EXIT_OK


def run_gc(args: argparse.Namespace) -> int:
    """``pool gc``: collect least recently used objects down to the cap."""
    # An empty value is a bad size, not "no cap" (an unset shell variable, say).
    cap = (parse_bytes(args.max_bytes, variable="--max-bytes") if args.max_bytes is not None
           else None)
    pool = existing_pool(args, max_bytes=cap)
    report = pool.gc(cap)
    if report.max_bytes is None:
        line = (f"no size cap (pass --max-bytes or set DISTCACHE_POOL_MAX_BYTES); kept "
                f"{report.kept} objects ({human_bytes(report.kept_bytes)})")
    else:
        line = (f"removed {report.removed} objects ({human_bytes(report.freed_bytes)}), "
                f"kept {report.kept} ({human_bytes(report.kept_bytes)}) with a cap of "
                f"{human_bytes(report.max_bytes)}")
    emit(args, {"root": pool.root, **dataclasses.asdict(report)}, [line])
    if report.max_bytes is not None and report.kept_bytes > report.max_bytes:
        # Asked to get under the cap and could not: a read-only or foreign-owned pool.
        cause = ("the pool is not writable" if not os.access(pool.layout.objects, os.W_OK)
                 else "see the warnings above")
        raise PoolError(
            f"pool gc: {pool.root} still holds {human_bytes(report.kept_bytes)} in "
            f"{report.kept} objects, over the cap of {human_bytes(report.max_bytes)}: "
            f"removed {report.removed}, the others could not be removed ({cause})",
            path=str(pool.root),
        )
    return EXIT_OK
