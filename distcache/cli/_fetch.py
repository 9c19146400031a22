"""``distcache fetch``: download a manifest's artifacts into the pool, in parallel.

Not collective: one process, one pool (``distcache prefetch`` is the job-wide
version). Each artifact goes through :meth:`ArtifactPool.fetch`, so concurrent
fetches into one pool download each object once and what is present is not
downloaded again.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from distcache._argtypes import path
from distcache._held import NoOrigin, missing_error
from distcache._resolve import resolve_origin, resolve_pool
from distcache.artifact import Artifact, merge_manifests, read_manifest
from distcache.cli._common import (
    EXIT_ERROR,
    EXIT_OK,
    UsageError,
    add_json_option,
    emit,
    human_bytes,
    not_writable,
    one_line,
    pool_root,
    refuse_foreign,
)
from distcache.cli._interrupt import run_threads
from distcache.config import settings
from distcache.errors import DistcacheError, OriginUnreachable, PoolError
from distcache.origins import Interrupted, Stopper
from distcache.store import PoolLayout

#: Failures printed to stderr one per line; the rest are counted.
_SHOWN_FAILURES = 10


def setup_fetch(parser: argparse.ArgumentParser) -> None:
    """Add the ``fetch`` options to its parser."""
    parser.add_argument("--manifest", type=path, action="append", required=True,
                        metavar="FILE", help="checksums.txt (sha256sum format) listing the "
                        "artifacts (repeatable: their union)")
    parser.add_argument("--prefix", default="", help="prefix joined in front of every name")
    parser.add_argument("--origin", action="append", metavar="URL",
                        help="origin URL or directory; repeat or comma-separate to fall back "
                             "in order (default: DISTCACHE_ORIGIN)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="parallel downloads (default: the smaller of "
                             "DISTCACHE_DOWNLOADS_PER_RANK and DISTCACHE_DOWNLOADS_PER_JOB)")
    add_json_option(parser)
    parser.set_defaults(run=run_fetch)


def say(line: str) -> None:
    """Print ``line`` on stderr; nothing where stderr is closed (``2>&-``: Python's
    ``sys.stderr`` is then None, and ``print`` would write the line to stdout, into
    the ``--json`` document)."""
    if sys.stderr is not None:
        print(line, file=sys.stderr)


def _progress(total: int) -> Any:
    """A progress bar on a terminal, else ``None`` (logs and pipes stay clean)."""
    if sys.stderr is None or not sys.stderr.isatty():
        return None
    from tqdm import tqdm  # third-party and only worth its import time on a terminal

    return tqdm(total=total, unit="artifact", file=sys.stderr)


def run_fetch(args: argparse.Namespace) -> int:
    """``fetch``: every artifact of the manifest into the pool; exit 1 if any failed."""
    conf = settings()
    # One process is the whole job here: the job's cap on concurrent downloads (a CDN's
    # rate limit) holds too.
    jobs = (args.jobs if args.jobs is not None
            else min(conf.downloads_per_rank, conf.downloads_per_job))
    if jobs < 1:
        raise UsageError(f"fetch: --jobs must be >= 1, got {jobs}")
    origin = resolve_origin(args.origin or None, conf)
    parts = [(str(m), read_manifest(m, args.prefix)) for m in args.manifest]
    merge_manifests(parts)  # one name with two digests in two files: said naming both
    # In the order given (a second name of one object then finds it in the pool), once.
    artifacts = list(dict.fromkeys(a for _, listed in parts for a in listed))
    root = pool_root(args)
    refuse_foreign(root)
    if (origin is None or conf.offline) and artifacts and not PoolLayout(root).is_pool():
        # Nothing to fetch from, and no pool yet to hold anything: refused, none made.
        raise missing_error(artifacts, offline=conf.offline,
                            where=[f"pool at {root} (none there yet)"], manifests=args.manifest)
    pool = resolve_pool(root, conf)
    try:
        pool.remember(artifacts)
    except PoolError as exc:
        raise not_writable(pool.root, exc) from exc
    present = {a.sha256 for a in artifacts if pool.has(a.sha256)}
    if origin is None or conf.offline:
        # What the pool holds needs no origin; what it lacks is one error, not one a file.
        missing = [a for a in artifacts if a.sha256 not in present]
        if missing:
            raise missing_error(missing, offline=conf.offline, where=[f"pool at {pool.root}"],
                                manifests=args.manifest)
        origin = NoOrigin(conf.offline)
    failures: list[tuple[Artifact, BaseException]] = []
    downloaded = nbytes = 0
    # Two names of one object: the second finds it in the pool; one download.
    counted: set[str] = set()
    bar = _progress(len(artifacts))
    # Daemon workers behind a Stopper: Ctrl-C stops the running downloads at their
    # next write and removes their temporary files, and leaves the queue undone.
    stopper = Stopper(origin)
    threads: list[threading.Thread] = []
    unwritable: PoolError | None = None
    try:
        # One batch, as prefetch and import: a size cap collects once the set is in,
        # never the set itself, and the publications are made durable together.
        with pool.batch():
            for artifact, data, error in run_threads(lambda a: pool.fetch(a, stopper.origin),
                                                     artifacts, jobs, threads=threads):
                if isinstance(error, PoolError) and unwritable is None:
                    # The pool cannot take any artifact: stop, and say so once.
                    unwritable = error
                    stopper.stop()
                if isinstance(error, Interrupted) and unwritable is not None:
                    continue
                if error is not None and not isinstance(error, DistcacheError):
                    raise error
                if isinstance(error, DistcacheError):
                    failures.append((artifact, error))
                elif data is not None and artifact.sha256 not in present | counted:
                    counted.add(artifact.sha256)
                    downloaded += 1
                    nbytes += len(data)
                if bar is not None:
                    bar.update(1)
    except KeyboardInterrupt:
        stopper.interrupt(pool.layout.tmp, threads)
        raise
    finally:
        if bar is not None:
            bar.close()
    if unwritable is not None:
        stopper.interrupt(pool.layout.tmp, threads)
        raise not_writable(pool.root, unwritable)
    failures.sort(key=lambda failure: failure[0].name)
    fetched = len(artifacts) - len(failures)
    summary = {
        "root": pool.root, "origin": origin.describe(), "artifacts": len(artifacts),
        "fetched": fetched, "downloaded": downloaded, "downloaded_bytes": nbytes,
        "already_present": fetched - downloaded, "failed": len(failures),
        "failures": [{"name": a.name, "error": one_line(e)} for a, e in failures],
    }
    emit(args, summary, [
        f"fetched {fetched} of {len(artifacts)} artifacts into {pool.root}: {downloaded} "
        f"downloaded ({human_bytes(nbytes)}) from {origin.describe()}, "
        f"{fetched - downloaded} already present, {len(failures)} failed"])
    # An unreachable origin is one cause, however many artifacts it failed: one line.
    down = [e for _, e in failures if isinstance(e, OriginUnreachable)]
    if down:
        say(f"distcache: {one_line(down[0])} ({len(down)} artifacts not fetched)")
    shown = [(a, e) for a, e in failures if not isinstance(e, OriginUnreachable)]
    for artifact, error in shown[:_SHOWN_FAILURES]:
        say(f"distcache: {artifact.name}: {one_line(error)}")
    if len(shown) > _SHOWN_FAILURES:
        say(f"distcache: ... and {len(shown) - _SHOWN_FAILURES} more failures")
    return EXIT_ERROR if failures else EXIT_OK
