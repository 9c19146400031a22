"""The options of ``python -m launch`` (:mod:`launch.__main__`): one parser, whose
errors are one line (it runs once per rank), and which refuses an option given twice
with two values (a mistake either way: the wrapper cannot tell which was meant)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from distcache._argtypes import directory

PROG = "python -m launch"


class UsageError(Exception):
    """The job cannot start as given: a bad option (the wrapper exits 2)."""


class _Once(argparse.Action):
    """Store the option's value; the same value again is taken, another is refused,
    naming the option (as spelt in full, however abbreviated) and both values."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            name = self.option_strings[-1]
            parser.error(f"{name} given twice, as {given!r} and {values!r}; give {name} "
                         "once, with the value meant")
        setattr(namespace, self.dest, values)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block: this runs once per rank.
        raise UsageError(message)


def make_parser() -> Parser:
    """The wrapper's parser: a bad option raises :class:`UsageError`."""
    parser = Parser(
        prog=PROG,
        description="Run PROGRAM with torchrun's environment under mpirun, srun, "
        "torchrun or alone.",
        epilog="Exported to PROGRAM: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT, GROUP_RANK and GROUP_WORLD_SIZE (where the launcher says), "
        "and DISTCACHE_POOL / DISTCACHE_WORKSPACE / "
        "DISTCACHE_PREFETCH_MANIFEST when the matching option is given.",
    )
    parser.add_argument("--pool", metavar="DIR", type=directory, action=_Once,
                        help="artifact pool directory (exported as DISTCACHE_POOL)")
    parser.add_argument(
        "--workspace",
        metavar="DIR",
        type=directory,
        action=_Once,
        help="give each rank a persistent slot DIR/rank-N, locked while PROGRAM runs; a "
        "busy slot moves on to the next free N (exported as DISTCACHE_WORKSPACE)",
    )
    parser.add_argument(
        "--prefetch",
        metavar="MANIFEST",
        action=_Once,
        help="run distcache's collective prefetch of this sha256sum manifest on every rank "
        "before PROGRAM starts (origin: DISTCACHE_ORIGIN), so PROGRAM's own loads hit the "
        "warm pool; also exported as DISTCACHE_PREFETCH_MANIFEST",
    )
    parser.add_argument(
        "--materialize",
        metavar="DIR",
        type=directory,
        action=_Once,
        help="after --prefetch, link every prefetched artifact to DIR/<name> so that a "
        "loader reading files by path finds it (default: $FLASHINFER_CUBIN_DIR when set, so "
        "FlashInfer loads hit locally; an installed or unwritable one: FlashInfer's cache)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="host this node's peer agent for PROGRAM's whole life (on the node's first rank) "
        "so that a lazy miss costs one origin request per job; exported as DISTCACHE_PEERS",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is exported")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- PROGRAM [ARGS...]")
    return parser
