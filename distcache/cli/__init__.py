"""The ``distcache`` command: inspect and fill artifact pools, check a machine.

    distcache [--pool DIR] [--verbose] pool ls|stats|verify|gc|import DIR|export DIR
    distcache [--pool DIR] fetch --manifest FILE [--origin URL ...] [--jobs N]
    distcache [--pool DIR] doctor
    distcache [--pool DIR] prefetch --manifest FILE | --flashinfer [--record DIR]  (every rank)

The pool is ``--pool``, else ``DISTCACHE_POOL``, else ``$XDG_CACHE_HOME/distcache``.

Exit codes:
    0    success
    1    an error: one line on stderr (``--verbose`` adds the traceback)
    2    bad usage (unknown command or option, missing argument)
    3    ``pool verify`` found corrupt objects (they were moved to quarantine/)
    130  interrupted

Subcommands are listed in :data:`SUBCOMMANDS`; each entry names a function that
fills in the subcommand's parser and sets ``run`` (``run(args) -> exit code``), so a
new command is one table entry and one module. Only the CLI configures logging.
Nothing here imports torch, except ``doctor`` on a machine with an NVIDIA device
where torch is installed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from distcache import __version__
from distcache.errors import DistcacheError

if TYPE_CHECKING:
    from distcache.store._pool import ArtifactPool

__all__ = ["EXIT_CORRUPT", "EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "SUBCOMMANDS", "Subcommand",
           "main"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_INTERRUPTED = 130

_EPILOG = """\
exit codes:
  0    success
  1    an error (one line on stderr; --verbose adds the traceback)
  2    bad usage
  3    'pool verify' found corrupt objects (moved to quarantine/)
  130  interrupted

environment: DISTCACHE_POOL, DISTCACHE_POOL_MAX_BYTES, DISTCACHE_ORIGIN,
DISTCACHE_ORIGIN_TOKEN, DISTCACHE_HTTP_TIMEOUT, DISTCACHE_HTTP_RETRIES
"""


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One ``distcache`` subcommand. ``setup`` is ``"module:function"``; the function
    receives the subcommand's parser, adds its arguments and sets ``run``."""

    name: str
    help: str
    setup: str


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("pool", "inspect and maintain an artifact pool", "distcache.cli:setup_pool"),
    Subcommand("fetch", "download a manifest's artifacts into the pool",
               "distcache.cli:setup_fetch"),
    Subcommand("doctor", "report launcher, pool filesystem, locks, shared memory, GPU IPC",
               "distcache.cli._doctor:setup_doctor"),
    Subcommand("prefetch", "collective (run on every rank): fetch each artifact once per job",
               "distcache.cli._prefetch:setup"),
)


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


def pool_root(args: argparse.Namespace) -> Path:
    """The pool directory: ``--pool``, else ``DISTCACHE_POOL``, else the default."""
    if args.pool is not None:
        return Path(args.pool)
    from distcache.config import settings

    return settings().pool_dir


def _open_pool(args: argparse.Namespace, *, create: bool = False) -> ArtifactPool:
    from distcache.store._pool import ArtifactPool

    root = pool_root(args)
    if not create and not (root / "objects").is_dir():
        raise DistcacheError(
            f"no pool at {root} (no objects/ directory); pass --pool DIR or set DISTCACHE_POOL, "
            "or create one with 'distcache fetch' or 'distcache pool import'"
        )
    return ArtifactPool(root)


# -- pool ------------------------------------------------------------------------------


def setup_pool(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="pool_command", metavar="ACTION", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=help, parents=[common_options()])

    ls = action("ls", "list named artifacts present in the pool (sha256sum format)")
    ls.set_defaults(run=_pool_ls)
    stats = action("stats", "object count, bytes, quarantine, cap")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(run=_pool_stats)
    verify = action("verify", "hash every object; quarantine corrupt ones (exit 3 if any)")
    verify.set_defaults(run=_pool_verify)
    gc = action("gc", "remove least recently used objects down to a cap")
    gc.add_argument("--max-bytes", metavar="SIZE",
                    help="cap, e.g. 20G (default: DISTCACHE_POOL_MAX_BYTES)")
    gc.set_defaults(run=_pool_gc)
    imp = action("import", "add a directory's files (checked against its checksums.txt "
                           "when present)")
    imp.add_argument("directory", type=Path, metavar="DIR")
    imp.set_defaults(run=_pool_import)
    exp = action("export", "write every named artifact and checksums.txt under DIR")
    exp.add_argument("directory", type=Path, metavar="DIR")
    exp.set_defaults(run=_pool_export)


def _pool_ls(args: argparse.Namespace) -> int:
    pool = _open_pool(args)
    for name, sha in sorted(pool.names().items()):
        if pool.has(sha):
            print(f"{sha}  {name}")
    return EXIT_OK


def _pool_stats(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    stats = _open_pool(args).stats()
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    if args.json:
        print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}))
        return EXIT_OK
    for key, value in fields.items():
        shown = value
        if key in ("bytes", "max_bytes"):
            shown = human_bytes(value) if value is None else f"{value} ({human_bytes(value)})"
        print(f"{key}: {shown}")
    return EXIT_OK


def _pool_verify(args: argparse.Namespace) -> int:
    pool = _open_pool(args)
    report = pool.verify()
    print(f"verified {report.ok + report.corrupt} objects in {pool.root}: {report.ok} ok "
          f"({human_bytes(report.ok_bytes)}), {report.corrupt} corrupt, "
          f"{report.quarantined} in quarantine")
    if report.corrupt:
        print(f"distcache: {report.corrupt} corrupt object(s) moved to "
              f"{pool.root / 'quarantine'}; they will be fetched again when needed",
              file=sys.stderr)
        return EXIT_CORRUPT
    return EXIT_OK


def _pool_gc(args: argparse.Namespace) -> int:
    from distcache.config import parse_bytes

    cap = parse_bytes(args.max_bytes, variable="--max-bytes") if args.max_bytes else None
    report = _open_pool(args).gc(cap)
    if report.max_bytes is None:
        print(f"no size cap (pass --max-bytes or set DISTCACHE_POOL_MAX_BYTES); kept "
              f"{report.kept} objects ({human_bytes(report.kept_bytes)})")
    else:
        print(f"removed {report.removed} objects ({human_bytes(report.freed_bytes)}), kept "
              f"{report.kept} ({human_bytes(report.kept_bytes)}) under a cap of "
              f"{human_bytes(report.max_bytes)}")
    return EXIT_OK


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


def _pool_import(args: argparse.Namespace) -> int:
    from distcache.artifact import Artifact, read_manifest, sha256_hex
    from distcache.origins._origin import DirOrigin

    source: Path = args.directory
    if not source.is_dir():
        raise UsageError(f"import: {source} is not a directory")
    pool = _open_pool(args, create=True)
    manifest = source / "checksums.txt"
    checked = manifest.is_file()
    new = nbytes = 0
    failures: list[str] = []
    imported: list[Artifact] = []
    if checked:
        mirror = DirOrigin(source)
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
    else:
        for name in _files_under(source):
            data = (source / name).read_bytes()
            sha = sha256_hex(data)
            new += not pool.has(sha)
            pool.put(data, sha)
            imported.append(Artifact(name, sha, len(data)))
            nbytes += len(data)
    pool.remember(imported)
    note = " (checked against checksums.txt)" if checked else ""
    print(f"imported {len(imported)} artifacts ({human_bytes(nbytes)}, {new} new objects) from "
          f"{source}{note} into {pool.root}")
    for message in failures:
        print(f"distcache: not imported: {message}", file=sys.stderr)
    return EXIT_ERROR if failures else EXIT_OK


def _pool_export(args: argparse.Namespace) -> int:
    from distcache.artifact import Artifact, manifest_text, read_manifest

    pool = _open_pool(args)
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


# -- fetch -----------------------------------------------------------------------------


def setup_fetch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", type=Path, required=True, metavar="FILE",
                        help="checksums.txt (sha256sum format) listing the artifacts")
    parser.add_argument("--prefix", default="", help="prefix joined in front of every name")
    parser.add_argument("--origin", action="append", metavar="URL",
                        help="origin URL or directory; repeat or comma-separate to fall back "
                             "in order (default: DISTCACHE_ORIGIN)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="parallel downloads (default: DISTCACHE_DOWNLOADS_PER_RANK)")
    parser.set_defaults(run=_fetch)


def _fetch(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from distcache.artifact import Artifact, read_manifest
    from distcache.config import settings
    from distcache.origins._origin import open_origin

    resolved = settings()
    jobs = args.jobs if args.jobs is not None else resolved.downloads_per_rank
    if jobs < 1:
        raise UsageError(f"fetch: --jobs must be >= 1, got {jobs}")
    specs = args.origin if args.origin else list(resolved.origins)
    if not specs:
        raise UsageError("fetch: no origin; pass --origin URL or set DISTCACHE_ORIGIN")
    artifacts = read_manifest(args.manifest, args.prefix)
    origin = open_origin(specs)
    pool = _open_pool(args, create=True)
    pool.remember(artifacts)
    present = {a.sha256 for a in artifacts if pool.has(a.sha256)}
    failures: list[tuple[Artifact, BaseException]] = []
    downloaded = nbytes = 0
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(artifacts), unit="artifact", file=sys.stderr)
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="distcache-fetch") as pool_ex:
        futures = {pool_ex.submit(pool.fetch, a, origin): a for a in artifacts}
        for future in as_completed(futures):
            artifact = futures[future]
            try:
                data = future.result()
            except DistcacheError as exc:
                failures.append((artifact, exc))
            else:
                if artifact.sha256 not in present:
                    downloaded += 1
                    nbytes += len(data)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    print(f"fetched {len(artifacts) - len(failures)} of {len(artifacts)} artifacts into "
          f"{pool.root}: {downloaded} downloaded ({human_bytes(nbytes)}) from {origin.describe()}, "
          f"{len(artifacts) - len(failures) - downloaded} already present, "
          f"{len(failures)} failed")
    for artifact, error in failures[:10]:
        print(f"distcache: {artifact.name}: {_one_line(error)}", file=sys.stderr)
    if len(failures) > 10:
        print(f"distcache: ... and {len(failures) - 10} more failures", file=sys.stderr)
    return EXIT_ERROR if failures else EXIT_OK


# -- main ------------------------------------------------------------------------------


def _load(spec: str) -> Callable[[argparse.ArgumentParser], None]:
    module, _, function = spec.partition(":")
    setup: Callable[[argparse.ArgumentParser], None] = getattr(
        importlib.import_module(module), function)
    return setup


def common_options() -> argparse.ArgumentParser:
    """A parent parser with --pool and --verbose, for every level of subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS lets the options also follow a subcommand without resetting them.
    common.add_argument("--pool", metavar="DIR", default=argparse.SUPPRESS,
                        help="pool directory (default: DISTCACHE_POOL, else "
                             "$XDG_CACHE_HOME/distcache)")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="debug logging and tracebacks on errors")
    return common


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every subcommand in :data:`SUBCOMMANDS`)."""
    common = common_options()
    parser = argparse.ArgumentParser(
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
        _load(sub.setup)(child)
    return parser


def _configure_logging(verbose: bool) -> Callable[[], None]:
    """Send log records to stderr; return the function that undoes it, so that
    calling :func:`main` in-process leaves the caller's logging as it was."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("distcache: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    quiet = logging.getLogger("urllib3")
    saved = (root.level, quiet.level)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if not verbose:
        quiet.setLevel(logging.ERROR)

    def restore() -> None:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        quiet.setLevel(saved[1])

    return restore


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help, --version, or bad usage
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    args.pool = getattr(args, "pool", None)
    args.verbose = getattr(args, "verbose", False)
    restore_logging = _configure_logging(args.verbose)
    try:
        return _run(parser, args)
    finally:
        restore_logging()


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"distcache: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("distcache: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`distcache pool ls | head`): not an error. Point stdout
        # at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OK
    except (DistcacheError, OSError) as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"distcache: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"distcache: internal error: {type(exc).__name__}: {_one_line(exc)}; "
              "rerun with --verbose for the traceback", file=sys.stderr)
        return EXIT_ERROR
