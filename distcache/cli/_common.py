"""What every ``distcache`` subcommand shares: the option convention (``--pool``,
``-v/--verbose`` at every level; ``--json`` on each command that reports), exit
codes, and the one function that prints a result as text or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distcache.config import settings

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad usage detected after parsing (exit code 2)."""


def human_bytes(nbytes: float | None) -> str:
    """``nbytes`` for people: ``"512 B"``, ``"1.5 GiB"``; ``None`` is ``"unlimited"``."""
    if nbytes is None:
        return "unlimited"
    value = float(nbytes)
    if value < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def one_line(exc: BaseException) -> str:
    """An error as one line of text: its message with all whitespace runs collapsed."""
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def pool_root(args: argparse.Namespace) -> Path:
    """The pool directory: ``--pool``, else ``DISTCACHE_POOL``, else the default.

    Raises:
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    if args.pool is not None:
        return Path(args.pool)
    return settings().pool_dir


def common_options() -> argparse.ArgumentParser:
    """A parent parser with ``--pool`` and ``--verbose``, for every level of subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS lets the options also follow a subcommand without resetting them.
    common.add_argument("--pool", metavar="DIR", default=argparse.SUPPRESS,
                        help="pool directory (default: DISTCACHE_POOL, else "
                             "$XDG_CACHE_HOME/distcache)")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging and tracebacks on errors")
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
    if getattr(args, "json", False) or not sys.stderr.isatty():
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
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")
