"""What every ``distcache`` subcommand shares: the option convention (``--pool``,
``-v/--verbose`` at every level; ``--json`` on each command that reports), exit
codes, and the one function that prints a result as text or as JSON."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any, NoReturn

from distcache._argtypes import directory
from distcache.config import check_seconds, settings
from distcache.errors import ConfigError, PoolError
from distcache.store import ArtifactPool, PoolLayout
from distcache.store._opening import refuse_foreign as refuse_foreign_pool

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad usage detected after parsing (exit code 2)."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that names an unknown option even when a required
    argument is also missing: argparse checks required arguments first, so
    ``distcache --frobnicate`` would otherwise say "the following arguments are
    required: COMMAND". Subparsers are built with the same class."""

    _parsing: tuple[str, ...] = ()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._parsing = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith(("the following arguments are required", "one of the arguments")):
            unknown = self.unknown_options(self._parsing)
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}"
        super().error(message)

    def unknown_options(self, tokens: Iterable[str]) -> list[str]:
        """The tokens of ``tokens`` that look like options this parser does not have
        (unique prefixes of long options count as known, as argparse allows them)."""
        known = list(self._option_string_actions)
        unknown = []
        for token in tokens:
            if token == "--":
                break
            if not token.startswith("-") or token == "-" or token[1:2].isdigit():
                continue
            if token.startswith("--"):
                name = token.split("=", 1)[0]
                if not any(option.startswith(name) for option in known if option[:2] == "--"):
                    unknown.append(token)
            elif token[:2] not in known:
                unknown.append(token)
        return unknown


def human_bytes(nbytes: float | None) -> str:
    """``nbytes`` for people: ``"512 B"``, ``"1.5 GiB"``, up to EiB, and past 1024 EiB
    in scientific notation (``"1.0e+30 B"``: an absurd cap reads as what it is, and one
    past a float's range prints at all); ``None`` is ``"unlimited"``."""
    if nbytes is None:
        return "unlimited"
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    if nbytes >= 1 << 70:
        return f"{Decimal(nbytes):.1e} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} EiB"


def one_line(exc: BaseException) -> str:
    """An error as one line of text: its message with all whitespace runs collapsed."""
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def not_writable(root: str | os.PathLike[str], exc: PoolError) -> PoolError:
    """The one error for a pool that refused a write (``exc``, the first refusal):
    it names the pool and the cause, in place of one line per artifact."""
    what = "is not writable" if exc.errno in _NOT_WRITABLE else "cannot be written"
    return PoolError(
        f"pool {os.fspath(root)} {what}: {exc}; nothing more was fetched: check its "
        "mount and permissions, or pass --pool DIR", path=os.fspath(root), errno=exc.errno,
    )


def pool_root(args: argparse.Namespace) -> Path:
    """The pool directory: ``--pool``, else ``DISTCACHE_POOL``, else the default.

    Raises:
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    if args.pool is not None:
        return Path(args.pool)
    return settings().pool_dir


def refuse_foreign(root: Path) -> None:
    """Refuse a directory that has ``objects/`` but is not a pool, before anything
    opens it as one (opening a pool records its format and identity there).

    Raises:
        PoolError: ``root`` has ``objects/`` and neither ``format`` nor ``pool_id``.
    """
    layout = PoolLayout(root)
    if layout.is_pool():
        refuse_foreign_pool(layout)


#: The ``pool`` actions that only read the pool: they open it read-only.
READING_ACTIONS = ("ls", "stats")


def existing_pool(args: argparse.Namespace, *, read_only: bool = False,
                  max_bytes: int | None = None) -> ArtifactPool:
    """The pool ``--pool`` (or the settings) names, which must already exist; with
    ``read_only``, ``--dry-run`` or for one of :data:`READING_ACTIONS`, opened to read
    it only, changing nothing there (:class:`~distcache.store.ArtifactPool`'s
    ``read_only``: no stale file swept, no directory made, no recency stamp). A
    ``max_bytes`` given (an option's cap) wins: ``DISTCACHE_POOL_MAX_BYTES`` is not
    read, and a bad value there does not stop the command.

    Raises:
        PoolError: there is no pool there, or the directory is not a pool (or, read
            only, its format is not the current one).
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    from distcache._resolve import resolve_pool

    conf = settings() if max_bytes is None else settings(pool_max_bytes=max_bytes)
    root = Path(args.pool) if args.pool is not None else conf.pool_dir
    refuse_foreign(root)
    read_only = (read_only or getattr(args, "dry_run", False)
                 or getattr(args, "pool_command", None) in READING_ACTIONS)
    if not read_only or not PoolLayout(root).is_pool():
        return resolve_pool(root, conf, must_exist=True)  # refuses a missing pool
    return ArtifactPool(root, max_bytes=conf.pool_max_bytes, read_only=True)


def check_families(names: Iterable[str], option: str = "--family") -> None:
    """Refuse a JIT cache family name that is not one (a typo would match nothing);
    ``option`` is the option that gave the names.

    Raises:
        ConfigError: a name is not one of :data:`distcache.jit.NAMES`.
    """
    from distcache.jit import NAMES

    for name in names:
        if name not in NAMES:
            raise ConfigError(f"{option}: unknown JIT cache {name!r}; the JIT caches are "
                              f"{', '.join(NAMES)}", variable=option, value=name)


def positive_seconds(text: str) -> float:
    """An option's value in seconds: above 0 and at most ``MAX_SECONDS``, as
    :func:`~distcache.config.check_seconds` checks it (argparse type).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        return check_seconds(text, what="")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def common_options() -> Parser:
    """A parent parser with ``--pool`` and ``--verbose``, for every level of subcommand."""
    common = Parser(add_help=False)
    # SUPPRESS lets the options also follow a subcommand without resetting them.
    common.add_argument("--pool", metavar="DIR", default=argparse.SUPPRESS, type=directory,
                        help="pool directory (default: DISTCACHE_POOL, else "
                             "$XDG_CACHE_HOME/distcache)")
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="every rank's progress and debug lines, tracebacks on "
                             "errors (-vv: also HTTP connections)")
    return common


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """Give a reporting command ``--json``; its handler prints through :func:`emit`."""
    parser.add_argument("--json", action="store_true",
                        help="print the result as one JSON document instead of text")


def _jsonable(value: object) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def emit(args: argparse.Namespace, data: object, lines: Iterable[str]) -> None:
    """Print a command's result: ``data`` as one JSON document when ``--json`` was
    given, else ``lines`` (a generator is only consumed for text), one per line.

    Raises:
        TypeError: ``data`` holds something JSON cannot represent (paths are written
            as strings).
    """
    if getattr(args, "json", False):
        print(json.dumps(data, default=_jsonable))
        return
    for line in lines:
        print(line)


class _Bar:
    """A :class:`~distcache.store._import.Progress` drawn with tqdm on stderr."""

    def __init__(self) -> None:
        self._bar: Any = None

    def phase(self, label: str, total_bytes: int | None) -> None:
        from tqdm import tqdm  # third-party and only worth its import time on a terminal

        self.close()
        self._bar = tqdm(total=total_bytes, desc=label, unit="B", unit_scale=True,
                         unit_divisor=1024, file=sys.stderr, leave=False)

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress_bar(args: argparse.Namespace) -> _Bar | None:
    """A byte progress bar on a terminal; ``None`` in logs, pipes and with ``--json``."""
    if getattr(args, "json", False) or sys.stderr is None or not sys.stderr.isatty():
        return None
    return _Bar()


def confirm(args: argparse.Namespace, question: str) -> bool:
    """Whether to go ahead with a removal: ``--yes``, else the answer to ``question``
    on a terminal.

    Raises:
        UsageError: neither ``--yes`` nor a terminal to ask on.
    """
    if getattr(args, "yes", False):
        return True
    if not sys.stdin.isatty():
        raise UsageError("refusing to remove without confirmation: pass --yes, or "
                         "--dry-run to see what would be removed")
    # The question goes to stderr: stdout holds only the result (one JSON document
    # with --json, even when redirected).
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")
