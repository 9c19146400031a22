"""The ``distcache`` parser, built from :data:`SUBCOMMANDS`, and the run loop: logging
set-up (:func:`distcache._logging.configure_logging`), and the mapping from what a
handler raises to an exit code and one line on stderr."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

from distcache import __version__
from distcache._logging import configure_logging, error_line
from distcache.cli._common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    UsageError,
    common_options,
    one_line,
)
from distcache.cli._doctor import setup_doctor
from distcache.cli._fetch import say, setup_fetch
from distcache.cli._pool import setup_pool
from distcache.cli._prefetch import setup as setup_prefetch
from distcache.errors import ConfigError, DistcacheError

_EPILOG = """\
exit codes:
  0    success
  1    an error (one line on stderr; --verbose adds the traceback), or a
       'pool gc' that could not get under its cap
  2    bad usage
  3    'pool verify' found corrupt objects (moved to quarantine/)
  130  interrupted (SIGINT)
  143  terminated (SIGTERM); like an interrupt, a partial tarball is removed

environment: DISTCACHE_POOL, DISTCACHE_POOL_MAX_BYTES, DISTCACHE_ORIGIN,
DISTCACHE_ORIGIN_TOKEN, DISTCACHE_HTTP_TIMEOUT, DISTCACHE_HTTP_RETRIES
"""


#: The exit code after SIGTERM: 128 + the signal number, as a shell reports it.
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so it unwinds (and cleans up) like Ctrl-C."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One ``distcache`` subcommand. ``setup`` receives the subcommand's parser, adds
    its arguments and sets ``run`` (``run(args) -> exit code``)."""

    name: str
    help: str
    setup: Callable[[argparse.ArgumentParser], None]


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("pool", "inspect and maintain an artifact pool", setup_pool),
    Subcommand("fetch", "download a manifest's artifacts into the pool", setup_fetch),
    Subcommand("doctor", "report launcher, pool filesystem, locks, shared memory, GPU IPC",
               setup_doctor),
    Subcommand("prefetch", "collective (run on every rank): fetch each artifact once per job",
               setup_prefetch),
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every subcommand in :data:`SUBCOMMANDS`)."""
    common = common_options()
    parser = Parser(
        prog="distcache", parents=[common], epilog=_EPILOG,
        description="Fetch kernel artifacts once per job; inspect and maintain artifact pools.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"distcache {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for sub in SUBCOMMANDS:
        child = commands.add_parser(sub.name, help=sub.help, description=sub.help,
                                    parents=[common], epilog=_EPILOG,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.setup(child)
        child.set_defaults(usage_of=child)  # a usage error after parsing shows this one
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``distcache`` command line; return the exit code (0 success, 1 error,
    2 bad usage, 3 corrupt objects found, 130 interrupted, 143 terminated). While it
    runs in the main thread, SIGTERM unwinds the command like Ctrl-C.

    Raises:
        Nothing: every error becomes an exit code and one line on stderr
            (``--verbose`` adds the traceback).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help, --version, or bad usage
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.pool = getattr(args, "pool", None)
    args.verbose = getattr(args, "verbose", 0)
    # Not collective yet: ``prefetch`` sets the rank once it has joined the job.
    restore_logging = configure_logging(args.verbose, None)
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    try:
        return _run(parser, args)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        restore_logging()


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except UsageError as exc:
        return _usage(args, parser, exc, f"distcache: error: {one_line(exc)}")
    except Terminated:
        say("distcache: terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        say("distcache: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`distcache pool ls | head`): not an error. Point stdout
        # at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK
    except (DistcacheError, OSError) as exc:
        if isinstance(exc, ConfigError) and str(getattr(exc, "variable", "")).startswith("--"):
            # An option's value: bad usage, as argparse's; one that every rank of a
            # collective command raised alike is printed by rank 0 alone.
            return _usage(args, parser, exc, error_line(
                "distcache", exc, one_line(exc), rank=getattr(args, "rank", None)))
        _traceback(args)
        # A collective command's error that every rank raised is printed by rank 0.
        line = error_line("distcache", exc, one_line(exc), rank=getattr(args, "rank", None))
        if line is not None:
            say(line)
        return EXIT_ERROR
    except Exception as exc:
        _traceback(args)
        say(f"distcache: internal error: {type(exc).__name__}: {one_line(exc)}; "
            "rerun with --verbose for the traceback")
        return EXIT_ERROR


def _traceback(args: argparse.Namespace) -> None:
    """The traceback of the error being handled, with ``--verbose``, on stderr (where
    stderr is closed, nowhere: ``traceback`` would print it on stdout)."""
    if args.verbose and sys.stderr is not None:
        traceback.print_exc(file=sys.stderr)


def _usage(args: argparse.Namespace, parser: argparse.ArgumentParser, exc: Exception,
           line: str | None) -> int:
    """Bad usage found after parsing: the subcommand's usage and ``line`` (none where
    another rank prints it), exit 2."""
    if line is not None:
        getattr(args, "usage_of", parser).print_usage(sys.stderr)  # None: argparse skips it
        say(line)
    return EXIT_USAGE
