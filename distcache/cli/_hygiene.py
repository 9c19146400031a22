"""``distcache pool rm NAME|GLOB ...`` and ``pool prune --older-than DURATION``: remove
what a pool no longer needs, the way ``hf cache rm``/``prune`` and ``conda clean`` do.

Both show what they would remove, then ask on a terminal; ``--yes`` skips the
question (and is required without a terminal), ``--dry-run`` only shows. What a
removal does to labels and objects: :mod:`distcache.store._prune`. An object that
cannot be deleted (a read-only pool) makes the command fail (exit 1), naming why.
"""

from __future__ import annotations

import argparse
import re
import sys

from distcache.cli._common import (
    EXIT_ERROR,
    EXIT_OK,
    add_json_option,
    confirm,
    emit,
    existing_pool,
    human_bytes,
)
from distcache.errors import ConfigError, PoolError
from distcache.store import ArtifactPool
from distcache.store._prune import Removal, apply, plan_prune, plan_rm

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_SHOWN = 20

RM_HELP = """\
Remove the labels whose name is NAME or matches GLOB (fnmatch; '*' also matches '/',
so 'abc123/fmha/*' is a whole pin), and delete the objects that only those labels point
at (bytes another label still uses are kept). Asks first on a terminal; --yes skips
the question, --dry-run only lists. A later lookup of a removed name fetches it again.
"""

PRUNE_HELP = """\
Delete the objects not used for DURATION (their recency stamp, which every read
refreshes), and every label that points at a deleted or missing object. DURATION is a
number and a unit: s, m, h, d or w (e.g. 30d, 12h). Asks first on a terminal; --yes
skips the question, --dry-run only lists.
"""


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (``"30d"``, ``"12h"``, ``"1.5w"``).

    Raises:
        ConfigError: not a number followed by one of s, m, h, d, w.
    """
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ConfigError(f"--older-than: bad duration {text!r}: expected a number and a "
                          "unit s, m, h, d or w, e.g. 30d or 12h",
                          variable="--older-than", value=text)
    return float(match.group(1)) * _UNITS[match.group(2)]


def _removal_options(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("-y", "--yes", action="store_true", help="remove without asking")
    mode.add_argument("--dry-run", action="store_true",
                      help="list what would be removed; change nothing")
    add_json_option(parser)


def setup_rm(parser: argparse.ArgumentParser) -> None:
    """Add the ``pool rm`` arguments."""
    parser.add_argument("patterns", nargs="+", metavar="NAME|GLOB")
    _removal_options(parser)
    parser.set_defaults(run=run_rm)


def setup_prune(parser: argparse.ArgumentParser) -> None:
    """Add the ``pool prune`` arguments."""
    parser.add_argument("--older-than", required=True, metavar="DURATION",
                        help="e.g. 30d, 12h, 90m")
    _removal_options(parser)
    parser.set_defaults(run=run_prune)


def _carry_out(args: argparse.Namespace, pool: ArtifactPool, removal: Removal,
               what: str) -> int:
    plan = (f"{len(removal.labels)} labels and {len(removal.objects)} objects "
            f"({human_bytes(removal.bytes)})")
    data: dict[str, object] = {
        "root": pool.root, "dry_run": args.dry_run, "labels": sorted(removal.labels),
        "objects": len(removal.objects), "bytes": removal.bytes,
    }
    if not removal.labels and not removal.objects:
        emit(args, data, [f"nothing to remove from {pool.root} ({what})"])
        return EXIT_OK
    if args.dry_run:
        lines = [f"would remove {plan} from {pool.root} ({what})"]
        lines += [f"  {name}" for name in sorted(removal.labels)[:_SHOWN]]
        if len(removal.labels) > _SHOWN:
            lines.append(f"  ... and {len(removal.labels) - _SHOWN} more")
        emit(args, data, lines)
        return EXIT_OK
    if not args.json and not args.yes:
        for name in sorted(removal.labels)[:_SHOWN]:
            print(f"  {name}")
    if not confirm(args, f"remove {plan} from {pool.root}?"):
        print("nothing removed", file=sys.stderr)
        return EXIT_ERROR
    labels, objects, freed = apply(pool, removal)
    failed = removal.failed
    data.update(labels_removed=labels, objects_removed=objects, bytes_freed=freed,
                objects_failed=len(failed))
    emit(args, data, [f"removed {labels} labels and {objects} objects "
                      f"({human_bytes(freed)}) from {pool.root}"])
    if failed:
        # Asked to delete and could not: a read-only or foreign-owned pool.
        causes = sorted(set(failed.values()))
        cause = "; ".join(causes[:3]) + (f"; and {len(causes) - 3} more" if len(causes) > 3
                                         else "")
        raise PoolError(
            f"pool {args.pool_command}: could not delete {len(failed)} of "
            f"{objects + len(failed)} objects from {pool.root} ({cause}); they are still "
            "there (see the warnings above)", path=str(pool.root))
    return EXIT_OK


def run_rm(args: argparse.Namespace) -> int:
    """``pool rm``: exit 1 when nothing matches."""
    pool = existing_pool(args)
    removal = plan_rm(pool, args.patterns)
    if not removal.labels:
        print(f"distcache: error: no label in {pool.root} matches "
              f"{' '.join(args.patterns)} (see 'distcache pool ls')", file=sys.stderr)
        return EXIT_ERROR
    return _carry_out(args, pool, removal, f"matching {' '.join(args.patterns)}")


def run_prune(args: argparse.Namespace) -> int:
    """``pool prune --older-than DURATION``: nothing to remove is success."""
    age = parse_duration(args.older_than)
    pool = existing_pool(args)
    return _carry_out(args, pool, plan_prune(pool, age), f"unused for {args.older_than}")
