"""``distcache prefetch``: warm every rank's pool collectively before serving.

Run it on every rank of the job (``mpirun -n N distcache prefetch ...``, ``srun``,
``torchrun``): the ranks agree on the list, each missing artifact is fetched once
per job and broadcast to the pools that lack it.

    distcache prefetch --manifest FILE [--manifest FILE ...] [--origin URL]
    distcache prefetch --flashinfer [--record DIR] [--family NAME ...] [--arch SM ...]
    distcache prefetch --jit inductor [--jit triton ...]   (what any pool holds, then
                                      each rank's cache directory is filled)
    distcache prefetch ... --dry-run [--json]   (not collective: what this pool lacks)

The ``distcache`` command registers :func:`setup`; :func:`add_parser` builds a
stand-alone parser. The handler :func:`run` returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

from distcache._argtypes import nonblank
from distcache._bounded import shell_pipe
from distcache._logging import configure_logging, reports_error
from distcache._resolve import ManifestSpec, prefetch_manifests, resolve_origin, resolve_pool
from distcache.artifact import merge_manifests, read_manifest
from distcache.cli._common import check_families, positive_seconds, refuse_foreign
from distcache.cli._fetch import say
from distcache.collective import PrefetchReport
from distcache.comm import Communicator, adopt, tell_others
from distcache.config import settings
from distcache.errors import ConfigError, DistcacheError
from distcache.integrations.flashinfer import FlashInfer
from distcache.integrations.flashinfer import prefetch as flashinfer_prefetch
from distcache.integrations.flashinfer._warm import ARCH_RULE
from distcache.origins import Origin, Stopper
from distcache.store import ArtifactPool

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add a stand-alone ``prefetch`` subcommand (with its own ``--pool``) to an
    ``argparse`` subparsers object; its ``func`` default is :func:`run`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "prefetch", help=HELP, description=DESCRIPTION
    )
    parser.add_argument("--pool", metavar="DIR", help="pool directory (default: DISTCACHE_POOL)")
    setup(parser)
    parser.set_defaults(func=run)
    return parser


HELP = "collectively fetch artifacts once per job into every rank's pool"
DESCRIPTION = (
    "Collective: run on every rank. Each artifact missing from some pool is "
    "fetched from the origin by one rank and broadcast to the pools that lack it."
)


def setup(parser: argparse.ArgumentParser) -> None:
    """Add the ``prefetch`` options to ``parser`` (the ``distcache`` command supplies
    ``--pool``)."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--manifest", action="append", type=nonblank, metavar="FILE",
                        help="a sha256sum-format manifest (repeatable)")
    source.add_argument("--flashinfer", action="store_true",
                        help="FlashInfer artifacts: the usage record and/or whole families")
    source.add_argument("--jit", action="append", metavar="NAME",
                        help="a JIT compile cache (inductor, triton, deep_gemm, "
                             "flashinfer_jit, vllm; repeatable): what any rank's pool holds "
                             "reaches every pool, then fills this rank's cache directory")
    parser.add_argument("--record", type=nonblank, metavar="DIR",
                        help="FlashInfer usage-record directory written by earlier runs")
    parser.add_argument("--family", action="append", default=[], metavar="NAME",
                        help="a whole FlashInfer artifact family, e.g. TRTLLM_GEN_FMHA "
                             "(repeatable; verified against FlashInfer's pinned hash)")
    parser.add_argument("--origin", metavar="URL",
                        help="origin URL or directory (default: DISTCACHE_ORIGIN, then "
                             "FlashInfer's FLASHINFER_CUBINS_REPOSITORY with --flashinfer)")
    parser.add_argument("--arch", action="append", default=[], metavar="SM",
                        help="keep only the family kernels GPUs of this architecture can "
                             "load, e.g. sm_90 or sm_100 (repeatable). " + ARCH_RULE)
    parser.add_argument("--timeout", type=positive_seconds, metavar="SECONDS",
                        help="collective timeout (default: DISTCACHE_TIMEOUT)")
    parser.add_argument("--dry-run", action="store_true",
                        help="not collective: list what this process's pool lacks, "
                             "download nothing (a family's checksums.txt must be in the "
                             "pool for its files to be listed)")
    parser.add_argument("--json", action="store_true",
                        help="print the result as one JSON document instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``distcache prefetch``; returns the exit status (0 ok, 1 failed, 2 usage)."""
    if not args.flashinfer and (args.record or args.family):
        say("distcache prefetch: --record and --family need --flashinfer")
        return 2
    if args.flashinfer and not (args.record or args.family):
        say("distcache prefetch: --flashinfer needs --record DIR and/or --family NAME")
        return 2
    if args.arch and not args.family:
        say("distcache prefetch: --arch filters whole families: it needs --flashinfer "
            "--family NAME")
        return 2
    if args.jit and args.dry_run:
        say("distcache prefetch: --dry-run lists manifests and FlashInfer artifacts, "
            "not --jit caches (see 'distcache pool ls --family')")
        return 2
    if args.jit:
        # Before the pool is opened (and made): a misspelt name leaves nothing behind.
        try:
            check_families(args.jit, "--jit")
        except ConfigError as exc:  # a malformed option value: bad usage, as elsewhere
            say(f"distcache prefetch: {exc}")
            return 2
    if args.family:
        # Before the pool is opened (and made), as --jit: a typo leaves nothing behind.
        from distcache.integrations.flashinfer._warm import family_checksums, parse_arch

        try:
            for arch in args.arch:
                parse_arch(arch)
            for family in args.family:
                family_checksums(family)
        except ConfigError as exc:  # a value given is malformed (2), else FlashInfer (1)
            say(f"distcache prefetch: {' '.join(str(exc).split())}")
            return 2 if getattr(exc, "value", None) is not None else 1
    try:
        if args.dry_run:
            from distcache.cli._dryrun import run_dry_run  # reads FlashInfer's pins

            _refuse_special_files(args.manifest or ())
            return run_dry_run(args)
        report, rank = _prefetch(args)
    except DistcacheError as exc:
        if reports_error(exc, getattr(args, "rank", None)):  # rank 0 prints an agreed one
            say(f"distcache prefetch: {' '.join(str(exc).split())}")
        return 1
    if rank == 0:
        _print_report(args, report)
    return 0


def _print_report(args: argparse.Namespace, report: PrefetchReport | None) -> None:
    if args.json:
        fields = report.as_dict() if report is not None else {}
        print(json.dumps({"summary": report.summary() if report is not None else None,
                          **fields}, default=str))
        return
    print(report.summary() if report is not None else "nothing to prefetch: no artifacts listed")


def _prefetch(args: argparse.Namespace) -> tuple[PrefetchReport | None, int]:
    # Settings -> communicator -> pool -> origin -> prefetch, as distcache.init does.
    conf = settings(timeout=args.timeout)
    started = time.perf_counter()
    adopted = adopt()
    stopper: Stopper | None = None
    pool: ArtifactPool | None = None
    # Progress from rank 0 only, once the rank is known; undone on the way out, so the
    # subcommand run in-process (not through main) leaves logging as it found it.
    restore_logging = configure_logging(getattr(args, "verbose", 0), adopted.comm.rank)
    try:
        comm = adopted.comm
        log.info("comm: %s backend, %d rank(s) (%.2f s)", comm.backend, comm.size,
                 time.perf_counter() - started)
        root = Path(args.pool) if args.pool is not None else conf.pool_dir
        refuse_foreign(root)
        # The inputs are checked before the pool is opened, which creates it: a
        # mistyped manifest, origin or record leaves no new pool behind.
        origin: Origin | None = None
        manifests: list[ManifestSpec] = []
        if args.flashinfer:
            _check_record(comm, args.record, conf.timeout)
            # FlashInfer's own repository is the fallback origin (prefetch resolves it).
            origin = resolve_origin(args.origin, conf, [FlashInfer()])
        elif not args.jit:
            # No origin is needed for what the pools hold; prefetch_manifests names
            # whatever no pool holds (and honours DISTCACHE_OFFLINE).
            origin = resolve_origin(args.origin, conf)
            manifests = _read_manifests(comm, args.manifest)
        pool = resolve_pool(root, conf)
        log.info("pool: %s (id %s)", pool.root, pool.pool_id)
        if args.flashinfer:
            stopper, origin = _stoppable(origin)
            warmed = flashinfer_prefetch(comm=comm, pool=pool, record=args.record,
                                         origin=origin, families=tuple(args.family),
                                         archs=tuple(args.arch), timeout=conf.timeout)
            return warmed, comm.rank
        if args.jit:
            return _prefetch_jit(comm, pool, args.jit, conf.timeout), comm.rank
        stopper, origin = _stoppable(origin)
        report = prefetch_manifests(comm, pool, origin, manifests=manifests,
                                    timeout=conf.timeout, offline=conf.offline)
        return report, comm.rank
    except BaseException as exc:
        # Before the close: the other ranks' waits raise this rank's error (its pool
        # or an input refused here alone) instead of waiting out the timeout.
        tell_others(adopted.comm, exc)
        if isinstance(exc, DistcacheError):
            args.rank = adopted.comm.rank  # the error line is printed once per job (main)
        elif isinstance(exc, KeyboardInterrupt) and stopper is not None and pool is not None:
            # The downloads run on the collective's daemon threads: stop them at their
            # next write and remove their temporary files, rather than leave them to
            # the stale sweep.
            stopper.interrupt(pool.layout.tmp, ())
        raise
    finally:
        adopted.close()
        restore_logging()


def _prefetch_jit(comm: Communicator, pool: ArtifactPool, names: list[str],
                  timeout: float | None) -> PrefetchReport | None:
    """Collective: the families' trees and files that any pool holds reach every pool
    (no origin: they came from ranks), then each rank fills its own directories."""
    from distcache.jit import families

    chosen = families(names, pool=pool)
    report = prefetch_manifests(comm, pool, None, integrations=chosen, timeout=timeout)
    for family in chosen:
        placed = family.materialize(pool)
        log.info("%s: %d file(s) written into %s, %d already there", family.name,
                 placed.written, family.materialize_dir(), placed.present)
    return report


def _stoppable(origin: Origin | None) -> tuple[Stopper | None, Origin | None]:
    if origin is None:
        return None, None
    stopper = Stopper(origin)
    return stopper, stopper.origin


def _read_manifests(comm: Communicator, manifests: list[str]) -> list[ManifestSpec]:
    """Read ``manifests`` before the pool is opened (and made), where this process is
    the whole job, and return what the prefetch is to take: the artifacts read from
    each, or the name of one that is a regular file (read again there, it names the
    file in what it says). A pipe (``<(...)``) is read once: a second read finds it
    drained. With more ranks the prefetch reads the manifests and the ranks agree on
    the error, so that a manifest only some of them cannot read leaves none waiting;
    a rank refusing alone here would. A named pipe or a device is refused here by a
    lone rank (:func:`_refuse_special_files`); with more ranks the prefetch's read
    refuses a named pipe, and the ranks agree on it.

    Raises:
        ConfigError: a manifest cannot be read, or is a named pipe or a device
            (:func:`_refuse_special_files`).
        ManifestError, ArtifactNameError: a manifest is malformed, or two of them list
            one name with two digests.
    """
    if comm.size != 1:
        return list(manifests)
    _refuse_special_files(manifests)
    read = [(manifest, read_manifest(manifest)) for manifest in manifests]
    merge_manifests(read)  # one name with two digests: said naming both files
    return [manifest if _regular_file(manifest) else artifacts for manifest, artifacts in read]


#: What a manifest that is neither a regular file nor a pipe may be, by its stat.
_SPECIAL = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _refuse_special_files(manifests: list[str] | tuple[str, ...]) -> None:
    """Refuse a manifest that is a named pipe, a device or a socket, before any is
    opened: opening a named pipe waits for a writer, for ever where none comes, and a
    terminal or a device is no manifest. A pipe a shell made (``<(command)``,
    ``/dev/stdin`` fed by ``|``) never waits to open and is read as before.

    Raises:
        ConfigError: naming the manifest, what it is, and what to pass instead.
    """
    for path in manifests:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # reading it says why it cannot be read, naming it
        what = next((kind for test, kind in _SPECIAL if test(mode)), None)
        if what is None or (stat.S_ISFIFO(mode) and shell_pipe(path)):
            continue
        raise ConfigError(
            f"--manifest {path} is {what}, not a regular file: reading it would wait for "
            "a writer or read no manifest; write the manifest to a file and pass that "
            "file, or pass a command's output as <(command)",
            variable="--manifest", value=path)


def _regular_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _check_record(comm: Communicator, record: str | None, timeout: float | None) -> None:
    """Collective: refuse a ``--record`` directory that no rank can see (a typo would
    otherwise prefetch nothing and succeed); one that only some ranks see is read
    where it is, as the usage record of a multi-node job is."""
    if record is None:
        return
    seen = comm.allgather_object(Path(record).is_dir(), timeout=timeout)
    if not any(seen):
        where = "this machine" if comm.size == 1 else f"any of the {comm.size} ranks"
        raise ConfigError(
            f"--record {record}: no such directory on {where}; pass the directory the "
            "engine's runs recorded into (the FlashInfer integration's record=...)",
            variable="--record", value=record,
        )
