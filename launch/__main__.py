"""``python -m launch [options] -- PROGRAM [ARGS...]``: run a program as torchrun would.

Under any launcher (mpirun, srun, torchrun, or none) each rank's program gets the
``env://`` variables ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, so an unmodified
``torch.distributed.init_process_group("gloo")`` works, and torchrun's node variables
``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` where the launcher says (:mod:`launch._environ`).
Under MPI, rank 0 picks a port below the ephemeral range whose next port (where
PROGRAM's distcache hosts its store) is free too, unless ``MASTER_PORT`` is set, and the
address and port travel over MPI; elsewhere they come from :func:`launch._detect`.

The program runs as a child in its own process group, as a shell runs a job (see
:mod:`launch._child`): on a terminal it gets the terminal; SIGINT, SIGTERM, SIGHUP,
SIGQUIT, SIGUSR1, SIGUSR2, SIGTSTP and SIGCONT are forwarded to it, and so is every
other signal that would end this process (SIGALRM, SIGXCPU, SIGPWR, ...: see
:data:`launch._child.FORWARDED`); it stops and continues with this process; it is
killed if this process dies; and its exit status (or the signal that killed it) becomes
ours.

Before PROGRAM starts, the wrapper's own exit codes are the ``distcache`` command's:
2 when the job cannot start as given (a bad option, launcher variables that
contradict each other, no rendezvous address or port), 1 when an option's work fails
(``--workspace``, ``--peers``, ``--prefetch``; one line on stderr), 130 interrupted
(SIGINT) and 143 terminated (SIGTERM), the prefetch's running downloads stopped and
their temporary files removed; 126 / 127 when PROGRAM cannot be run.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

import distcache
from distcache._logging import configure_logging, error_line
from distcache._resolve import resolve_origin, resolve_pool
from distcache.artifact import read_manifest
from distcache.comm import adopt, tell_others
from distcache.config import settings
from distcache.errors import DistcacheError
from distcache.integrations.flashinfer import FlashInfer
from distcache.integrations.flashinfer._upstream import is_installed_location, writable_cubin_dir
from distcache.peer import Hosted, origin_or_default, start
from distcache.store import PoolLayout
from launch._child import exit_like, run
from launch._detect import LaunchInfo, detect
from launch._dist import mpi_publish, rendezvous_address
from launch._environ import child_environment
from launch._options import PROG, UsageError, make_parser
from launch._rendezvous import free_port_pair
from launch._workspace import WorkspaceSlot, acquire_slot

log = logging.getLogger("launch")

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(KeyboardInterrupt):
    """SIGTERM during the set-up, raised where the set-up is, so that it unwinds (and
    removes the prefetch's temporary files) like Ctrl-C."""


#: Whether SIGTERM unwinds the set-up now ([True]), or, once the set-up is being
#: undone (a failure's clean-up, MPI's finalize), is only noted ([False, noted]): an
#: exception raised there would cut the clean-up short.
_UNWINDS = [True, False]


def _terminate(signum: int, frame: FrameType | None) -> None:
    if _UNWINDS[0]:
        raise _Terminated
    _UNWINDS[1] = True


def _rendezvous(info: LaunchInfo) -> LaunchInfo:
    if info.master_addr is not None and info.master_port is not None:
        return info
    if info.is_mpi and info.world_size > 1:
        def choose(hosts: list[str]) -> tuple[str, int]:
            # A MASTER_PORT the user set is kept; otherwise one outside the ephemeral
            # range whose next port (PROGRAM's distcache store) is free too.
            host = info.master_addr or rendezvous_address(hosts)
            return host, info.master_port or free_port_pair()

        host, port = mpi_publish(info, choose)
        return info.replace(master_addr=host, master_port=port)
    if info.world_size == 1:
        host = info.master_addr or "127.0.0.1"
        return info.replace(master_addr=host, master_port=info.master_port or free_port_pair())
    # Name what is missing (a MASTER_ADDR the user set is not), and why Slurm gives none.
    missing = {name: hint for name, value, hint in (
        ("MASTER_ADDR", info.master_addr, "MASTER_ADDR to rank 0's host name"),
        ("MASTER_PORT", info.master_port, "MASTER_PORT to a free port on rank 0's host"))
        if value is None}
    why = ""
    if info.launcher == "slurm" and info.master_addr is None:
        why = (" (with SLURM_DISTRIBUTION=arbitrary or SLURM_HOSTFILE the step's first node "
               "need not be rank 0's)" if "arbitrary" in os.environ.get("SLURM_DISTRIBUTION", "")
               or "SLURM_HOSTFILE" in os.environ else " (SLURM_STEP_NODELIST is not set)")
    raise UsageError(
        f"{info.launcher} launch of {info.world_size} ranks gives no {' or '.join(missing)}"
        f"{why}; set {' and '.join(missing.values())}, the same on every rank"
    )


def _prefetch(
    info: LaunchInfo, manifest: Path, pool: str | None, materialize: Path | None,
    *, strict: bool = True,
) -> None:
    """Run the start-up hook (prefetch only) before PROGRAM, on every rank, and link
    what it fetched into ``materialize`` (FlashInfer reads ``<dir>/<name>`` and checks
    its SHA-256 before it would download, so an unmodified engine then loads locally).

    The communicator comes from :func:`distcache.comm.adopt` and is distcache's own:
    under MPI a duplicate of the world, freed before PROGRAM starts (MPI itself is
    finalized by :func:`main`, after every option has run; PROGRAM is a separate process
    and makes its own ``MPI_Init``); under torchrun or srun a private gloo group on the
    launcher's rendezvous store (srun: a store rank 0 hosts one port above
    ``MASTER_PORT``), discarded before PROGRAM starts. torch.distributed's default
    group is never initialised here, so PROGRAM's ``init_process_group`` finds
    ``MASTER_PORT`` free.

    Ctrl-C (or SIGTERM) stops the running downloads at their next write and removes
    their temporary files, as ``distcache prefetch`` does: the downloads run on the
    collective's daemon threads, which would otherwise leave them to the stale sweep.
    A ``materialize`` directory that refuses a file fails the job when it was asked
    for (``strict``); else it is left with one warning, and PROGRAM still runs.
    """
    # The distcache command's package, loaded only by a wrapper that prefetches.
    from distcache.origins import Stopper

    # No peer agents for the prefetch alone: it moves what a manifest names, and
    # --peers hosts the agents the program's lookups use.
    environ = {**os.environ, "DISTCACHE_PEERS": "0"}
    conf = settings(environ)
    tmp = PoolLayout(Path(pool) if pool is not None else conf.pool_dir).tmp
    try:
        origin = resolve_origin(None, conf)
    except DistcacheError:
        # Left for init to refuse, on every rank of the job at once.
        origin = None
    stopper = Stopper(origin) if origin is not None else None
    adopted = adopt(info)
    try:
        comm = adopted.comm
        try:
            session = distcache.init(comm=comm, pool=pool, manifests=[manifest],
                                     integrations=(), environ=environ,
                                     origin=stopper.origin if stopper is not None else None)
        except KeyboardInterrupt:
            if stopper is not None:
                stopper.interrupt(tmp, ())
            raise
        if materialize is not None and session.pool is not None:
            # Concurrent calls from every rank are safe: an existing correct file is
            # kept and a new one is placed by an atomic rename.
            for artifact in read_manifest(manifest):
                try:
                    session.pool.materialize(artifact, materialize)
                except OSError as exc:  # PoolError included
                    if strict:
                        raise
                    log.warning("%s: the prefetched files are not linked into %s: %s",
                                PROG, materialize, " ".join(str(exc).split()))
                    break
        session.close()
    finally:
        adopted.close()


def _host_peers(info: LaunchInfo, pool: str | None) -> Hosted | None:
    """Start the node agents of the job (:func:`distcache.peer.start`) over a
    communicator of distcache's own, discarded before PROGRAM starts: the agents keep
    serving from this process, on threads, until it exits. ``None`` on one node."""
    conf = settings()
    adopted = adopt(info)
    try:
        the_origin = resolve_origin(None, conf, [FlashInfer()])
        return start(adopted.comm, resolve_pool(pool, conf), origin_or_default(the_origin),
                     adopted.scope.secret, timeout=conf.timeout)
    except BaseException as exc:
        # The pool or origin refused on this rank alone (before the agents' first
        # collective): the other ranks' waits raise it instead of timing out.
        tell_others(adopted.comm, exc)
        raise
    finally:
        adopted.close()


def _finalize_mpi() -> None:
    """Finalize MPI if this process initialised it (the rendezvous under MPI imports
    mpi4py, whose import is ``MPI_Init``; so may --peers and --prefetch), before PROGRAM
    starts: PROGRAM's ranks make their own ``MPI_Init`` under this rank's identity, and
    a wrapper still holding its shared-memory endpoints could take a fragment meant for
    them (a crash in ``MPI_Finalize`` at the wrapper's exit)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def _materialize_dir(option: str | None, rank: int) -> Path | None:
    """``--materialize``, else ``FLASHINFER_CUBIN_DIR`` where the integration would write
    it (:func:`writable_cubin_dir`: never an installed package's directory, else
    FlashInfer's cache); ``None`` when neither can be written (rank 0 warns)."""
    if option is not None:
        return Path(option)
    current = FlashInfer().materialize_dir()
    target = writable_cubin_dir(current) if current is not None else None
    if current is not None and target != current and rank == 0:
        log.warning("%s: FLASHINFER_CUBIN_DIR=%s is %s; the prefetched files are %s", PROG,
                    current, "installed" if is_installed_location(current) else "not writable",
                    f"linked into {target}" if target is not None else "not linked")
    return target


def _fail(status: int, line: str | None, hosted: Hosted | None) -> NoReturn:
    _UNWINDS[0] = False  # a SIGTERM from here on waits for the clean-up
    if line is not None:
        print(line, file=sys.stderr)
    if hosted is not None:  # its socket and key file are removed with it
        hosted.close()
    _finalize_mpi()
    if _UNWINDS[1] and status != EXIT_TERMINATED:
        print(f"{PROG}: terminated", file=sys.stderr)
        status = EXIT_TERMINATED
    sys.exit(status)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args_in = list(sys.argv[1:] if argv is None else argv)
    slot: WorkspaceSlot | None = None
    hosted: Hosted | None = None
    on_main = threading.current_thread() is threading.main_thread()
    # Until PROGRAM starts, SIGTERM unwinds the set-up like Ctrl-C; while it runs,
    # launch._child forwards both to it.
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    # Until the ranks agree on a rendezvous, an error is the launch's set-up (its
    # options, the launcher's variables, MASTER_PORT): exit 2, the job cannot start
    # as given. After it, an option's work failed (a workspace, the peers, the
    # prefetch): exit 1, as the distcache command exits for an error.
    failed = EXIT_USAGE
    try:
        args = make_parser().parse_args(args_in)
        configure_logging(int(args.verbose), None)  # warnings only until the rank is known
        command = list(args.command)
        if command[:1] == ["--"]:
            command = command[1:]
        if not command:
            raise UsageError("no PROGRAM given; usage: python -m launch [options] -- PROGRAM [ARGS...]")
        extra: dict[str, str] = {}
        if args.pool is not None:
            extra["DISTCACHE_POOL"] = str(Path(args.pool).absolute())
        if args.prefetch is not None:
            manifest = Path(args.prefetch)
            if not manifest.is_file():
                raise UsageError(f"--prefetch {args.prefetch}: " + (
                    "not a file (give the manifest, a checksums.txt)" if manifest.exists()
                    else "no such file"))
            extra["DISTCACHE_PREFETCH_MANIFEST"] = str(manifest.absolute())
        if args.materialize is not None and args.prefetch is None:
            raise UsageError("--materialize needs --prefetch MANIFEST")
        if args.materialize is not None and Path(args.materialize).exists() and not Path(
                args.materialize).is_dir():
            raise UsageError(f"--materialize {args.materialize}: not a directory")
        info = _rendezvous(detect())
        failed = EXIT_ERROR
        configure_logging(int(args.verbose), info.rank)  # progress from rank 0; -v: every rank
        if args.workspace is not None:
            slot = acquire_slot(args.workspace, start=info.rank)
            extra["DISTCACHE_WORKSPACE"] = str(slot.path)
        if args.peers:
            hosted = _host_peers(info, extra.get("DISTCACHE_POOL"))
            # Set on every rank: "0" where this node has no agent (it could not start, or
            # the job is on one node), so that PROGRAM's init starts none of its own,
            # whose collectives the other nodes' ranks would never join.
            tier = hosted.tier if hosted is not None else None
            extra["DISTCACHE_PEERS"] = "0" if tier is None else tier.endpoint.removeprefix("unix:")
        env = child_environment(info, dict(os.environ), extra)
        if args.prefetch is not None:
            _prefetch(info, Path(extra["DISTCACHE_PREFETCH_MANIFEST"]), extra.get("DISTCACHE_POOL"),
                      _materialize_dir(args.materialize, info.rank),
                      strict=args.materialize is not None)
    except UsageError as exc:
        _fail(EXIT_USAGE, error_line(PROG, exc, " ".join(str(exc).split())), hosted)
    except (DistcacheError, OSError) as exc:
        # An error every rank raised: rank 0 prints it.
        _fail(failed, error_line(PROG, exc, " ".join(str(exc).split())), hosted)
    except _Terminated:
        _fail(EXIT_TERMINATED, f"{PROG}: terminated", hosted)
    except KeyboardInterrupt:
        _fail(EXIT_INTERRUPTED, f"{PROG}: interrupted", hosted)
    finally:
        # MPI is the set-up's alone, whichever options ran: finalized before PROGRAM
        # starts (or the wrapper exits), never left up beside PROGRAM's own MPI_Init.
        _UNWINDS[0] = False
        _finalize_mpi()
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if _UNWINDS[1]:  # terminated while MPI was being finalized: PROGRAM never starts
        _fail(EXIT_TERMINATED, f"{PROG}: terminated", hosted)
    try:
        status = run(command, env, terminal=info.local_world_size == 1)
    except OSError as exc:
        print(f"{PROG}: error: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)
    finally:
        if slot is not None:
            slot.release()
        if hosted is not None:
            hosted.close()
    exit_like(status)


if __name__ == "__main__":
    main()
