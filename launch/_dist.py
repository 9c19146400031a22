"""Bring up ``torch.distributed`` from whatever launcher started the process.

This is the only module of ``launch`` that touches ``torch.distributed`` or the
environment. Rendezvous, by launcher:

* already initialised -- adopted as is (an engine that initialised first wins);
* MPI (Open MPI, MPICH/Intel MPI, PMIx) -- rank 0 opens a ``TCPStore`` on a port the
  OS chooses and broadcasts ``(host, port)`` over mpi4py; the others connect. No rank
  guesses a free port, so nothing races for it;
* torchrun / ``python -m launch`` / Slurm -- ``MASTER_ADDR`` and ``MASTER_PORT`` from
  :func:`launch._detect` (for Slurm: the step's first node and a port derived from the
  job id): rank 0 hosts the store there, listening on that address only
  (:func:`launch._rendezvous.host_store`), the others connect. Where torchrun's agent
  hosts the store (``TORCHELASTIC_USE_AGENT_STORE``), ``env://`` connects to it;
* one process -- an in-memory store.

Backend: ``gloo`` on CPU; ``nccl`` when CUDA is available, plus a ``gloo`` side group
for CPU collectives (:func:`gloo_group`), as vLLM and TensorRT-LLM keep one.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from distcache._log import get_logger
from distcache.config import settings
from distcache.errors import CollectiveTimeout, CommError, LaunchError
from launch._detect import LaunchInfo, check_mpi_place, detect
from launch._mpiwire import allgather_str, bcast_message
from launch._rendezvous import client_store, host_store

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

log = get_logger(__name__)



@dataclass
class _Bringup:
    """What this process created; torch.distributed's own state is process-global too.

    Groups are held weakly: a strong reference kept past ``destroy_process_group()``
    makes gloo's threads outlive the interpreter's teardown, which aborts the process
    ("terminate called without an active exception").
    """

    world: weakref.ref[Any]
    side_group: weakref.ref[Any] | None

    def current(self) -> bool:
        import torch.distributed as dist

        return dist.is_initialized() and self.world() is dist.group.WORLD


_state: _Bringup | None = None


def _set_env(name: str, value: str) -> None:
    if os.environ.get(name) != value:
        log.info("setting %s=%s", name, value)
        os.environ[name] = value


def rendezvous_address(all_hosts: list[str]) -> str:
    """The address rank 0 should listen on and publish, given every rank's host name.

    One host: ``127.0.0.1`` (always reachable, never a firewalled NIC). Several: the
    first non-loopback IPv4 address this host's name resolves to; a name resolving only
    to loopback (Debian's ``127.0.1.1`` entry) is useless to other hosts, so that case
    raises instead of producing a hang (DeepSpeed #5136; set ``MASTER_ADDR``).

    Raises:
        LaunchError: ranks span several hosts and no routable address was found.
    """
    if len(set(all_hosts)) <= 1:
        return "127.0.0.1"
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        addr = str(info[4][0])
        if not addr.startswith("127."):
            return addr
    raise LaunchError(
        f"ranks run on {len(set(all_hosts))} hosts but {name!r} resolves only to loopback; "
        "set MASTER_ADDR to an address of rank 0's host that the others can reach",
        variable="MASTER_ADDR",
        value="",
    )


def _translate(exc: BaseException, what: str, info: LaunchInfo) -> Exception:
    import torch.distributed as dist

    where = f"rank {info.rank}/{info.world_size} on {info.node_id}"
    if isinstance(exc, (dist.DistStoreError, TimeoutError)):
        return CollectiveTimeout(
            f"{where}: {what} timed out ({exc}); check that every rank was started and "
            f"can reach {info.master_addr}:{info.master_port}",
            op=what,
            rank=info.rank,
        )
    return CommError(f"{where}: {what} failed: {exc}", op=what, rank=info.rank, backend="torch")


def _mpi_world(info: LaunchInfo) -> Any:
    try:
        # Importing mpi4py.MPI calls MPI_Init; only ever reached under an MPI launcher.
        from mpi4py import MPI
    except ImportError as exc:
        raise CommError(
            f"launched by {info.launcher} but mpi4py is not importable ({exc}); "
            "install distcache[mpi], or set MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE",
            op="init_process_group",
            rank=info.rank,
        ) from exc
    comm = MPI.COMM_WORLD
    check_mpi_place(info, comm.Get_rank(), comm.Get_size())
    return comm


def agree_on_address(
    rank: int,
    allgather: Callable[[Any], list[Any]],
    broadcast: Callable[[Any], Any],
    choose: Callable[[list[str]], tuple[str, int]],
) -> tuple[str, int]:
    """Agree on a rendezvous ``(host, port)`` over any transport: every rank's host
    name is all-gathered, rank 0 calls ``choose(host_names)`` and its answer is
    broadcast. If ``choose`` raises on rank 0, every rank raises (rather than waiting
    in the broadcast forever).

    Raises:
        CommError: ``choose`` failed on rank 0.
    """
    hosts = allgather(socket.gethostname())
    message: tuple[str, str, int] = ("", "", 0)
    if rank == 0:
        try:
            host, port = choose(hosts)
            message = ("ok", host, port)
        except Exception as exc:
            message = ("error", f"{type(exc).__name__}: {exc}", 0)
    status, host, port = broadcast(message)
    if status != "ok":
        raise CommError(
            f"rank {rank}: rank 0 could not choose a rendezvous address: {host}",
            op="rendezvous",
            rank=0,
        )
    return host, port


def mpi_publish(info: LaunchInfo, choose: Callable[[list[str]], tuple[str, int]]) -> tuple[str, int]:
    """:func:`agree_on_address` over MPI; collective over ``COMM_WORLD``.

    Raises:
        CommError: mpi4py is missing, or ``choose`` failed on rank 0.
        CollectiveTimeout: a rank did not join an exchange within ``init_timeout``.
        LaunchError: MPI's rank or size contradicts ``info``.
    """
    comm = _mpi_world(info)
    wait = settings().init_timeout  # each exchange: a rank that never comes is named
    return agree_on_address(info.rank, lambda m: allgather_str(comm, m, wait),
                            lambda m: bcast_message(comm, m, wait), choose)


def publish_store(
    rank: int,
    size: int,
    allgather: Callable[[Any], list[Any]],
    broadcast: Callable[[Any], Any],
    timeout: timedelta,
    *,
    host: str | None = None,
    port: int | None = None,
) -> tuple[str, int, Store]:
    """A ``TCPStore`` every rank reaches: rank 0 hosts it (on ``port``, else one the OS
    picks and keeps bound, so no other process can take it between choosing and
    listening; on ``host``'s address only, :func:`launch._rendezvous.host_store`) and its
    address travels over the given transport; the others connect.

    Raises:
        CommError: rank 0 could not host the store (on every rank alike).
        RuntimeError, ValueError: this rank could not connect (torch's errors).
    """
    hosted: list[Store] = []

    def open_master(hosts: list[str]) -> tuple[str, int]:
        where = host or rendezvous_address(hosts)
        # Listens on ``where`` only (not every interface) where torch allows it.
        store = host_store(where, port or 0, size, timeout, spans_hosts=len(set(hosts)) > 1,
                           what="the job's rendezvous store",
                           hint="set MASTER_PORT to a free port below 32768, or unset it "
                                "to let the OS choose one")
        hosted.append(store)
        return where, int(store.port)

    where, chosen = agree_on_address(rank, allgather, broadcast, open_master)
    if hosted:
        return where, chosen, hosted[0]
    return where, chosen, client_store(where, chosen, size, timeout)


def _mpi_store(info: LaunchInfo, timeout: timedelta) -> tuple[LaunchInfo, Store]:
    comm = _mpi_world(info)
    wait = timeout.total_seconds()
    try:
        host, port, store = publish_store(
            info.rank, info.world_size, lambda m: allgather_str(comm, m, wait),
            lambda m: bcast_message(comm, m, wait),
            timeout, host=info.master_addr, port=info.master_port,
        )
    except CollectiveTimeout:  # the MPI exchange: it names what a rank never joined
        raise
    except (RuntimeError, ValueError, OSError) as exc:
        raise _translate(exc, "connecting to the rendezvous store", info) from exc
    return info.replace(master_addr=host, master_port=port), store


def _env_store(info: LaunchInfo, timeout: timedelta) -> Store:
    """The ``MASTER_ADDR:MASTER_PORT`` store: hosted by rank 0 on that address only
    (``env://`` would bind every interface) with a clear error when the port is taken."""
    assert info.master_addr is not None and info.master_port is not None  # checked above
    if info.rank == 0:
        derived = "the port was derived from SLURM_JOB_ID; " if "SLURM_JOB_ID" in info.source else ""
        return host_store(info.master_addr, info.master_port, info.world_size, timeout,
                          spans_hosts=not info.single_node, what="the job's rendezvous store",
                          hint=f"{derived}set MASTER_PORT to a free port below 32768")
    try:
        return client_store(info.master_addr, info.master_port, info.world_size, timeout)
    except (RuntimeError, ValueError, OSError) as exc:
        raise _translate(exc, "connecting to the rendezvous store", info) from exc


def _export(info: LaunchInfo) -> None:
    _set_env("RANK", str(info.rank))
    _set_env("WORLD_SIZE", str(info.world_size))
    if info.local_rank is not None:
        _set_env("LOCAL_RANK", str(info.local_rank))
    if info.local_world_size is not None:
        _set_env("LOCAL_WORLD_SIZE", str(info.local_world_size))
    if info.master_addr is not None:
        _set_env("MASTER_ADDR", info.master_addr)
    if info.master_port is not None:
        _set_env("MASTER_PORT", str(info.master_port))


def _side_group(backend: str, timeout: timedelta) -> Any:
    import torch.distributed as dist

    if "gloo" in backend:
        return None  # the default group already runs CPU collectives
    # new_group is collective: every rank reaches this line in the same order.
    return dist.new_group(backend="gloo", timeout=timeout)


def _remember(side: Any) -> _Bringup:
    import torch.distributed as dist

    return _Bringup(
        world=weakref.ref(dist.group.WORLD),
        side_group=None if side is None else weakref.ref(side),
    )


def init_process_group(
    info: LaunchInfo | None = None,
    backend: str | None = None,
    timeout: float | None = None,
) -> LaunchInfo:
    """Initialise ``torch.distributed`` for this launch; collective, idempotent.

    ``info`` defaults to :func:`launch._detect`; ``backend`` to ``nccl`` when CUDA is
    available, else ``gloo``; ``timeout`` (seconds) to the ``init_timeout`` setting
    (``DISTCACHE_INIT_TIMEOUT``, default 300). Sets (and logs) ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` where they
    differ, so code that reads them later sees this job. Returns the ``LaunchInfo``
    with the rendezvous address and port filled in.

    Raises:
        LaunchError: the launcher environment is malformed or contradicts MPI, or no
            rendezvous address is known (set ``MASTER_ADDR``).
        CollectiveTimeout: not every rank joined within ``timeout``.
        CommError: mpi4py or torch.distributed failed.
    """
    global _state
    import torch
    import torch.distributed as dist

    delta = timedelta(seconds=settings(init_timeout=timeout).init_timeout)
    if info is None:
        info = detect()
    if dist.is_initialized():
        return _adopt(info, delta)

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend and info.local_rank is not None:
        torch.cuda.set_device(info.local_rank % max(torch.cuda.device_count(), 1))

    store: Any = None
    if info.world_size == 1:
        store = dist.HashStore()
    elif info.is_mpi:
        info, store = _mpi_store(info, delta)
    elif info.master_addr is None or info.master_port is None:
        raise LaunchError(
            f"{info.launcher} launch of {info.world_size} ranks has no rendezvous address "
            f"(MASTER_ADDR={info.master_addr}, MASTER_PORT={info.master_port}); "
            "set MASTER_ADDR and MASTER_PORT",
            variable="MASTER_ADDR",
            value=str(info.master_addr),
        )
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # else the agent hosts it
        store = _env_store(info, delta)
    _export(info)
    try:
        if store is not None:
            dist.init_process_group(
                backend, store=store, rank=info.rank, world_size=info.world_size, timeout=delta
            )
        else:
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=info.rank,
                world_size=info.world_size,
                timeout=delta,
            )
        side = _side_group(backend, delta)
    except (RuntimeError, ValueError) as exc:
        raise _translate(exc, "init_process_group", info) from exc
    _state = _remember(side)
    log.info(
        "torch.distributed up: rank %d/%d on %s, backend %s, rendezvous %s:%s (%s)",
        info.rank, info.world_size, info.node_id, backend, info.master_addr,
        info.master_port, info.launcher,
    )
    return info


def _adopt(info: LaunchInfo, timeout: timedelta) -> LaunchInfo:
    global _state
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank, world) != (info.rank, info.world_size):
        log.warning(
            "adopting torch.distributed as rank %d/%d although %s said %d/%d",
            rank, world, info.launcher, info.rank, info.world_size,
        )
        info = info.replace(rank=rank, world_size=world)
    if _state is None or not _state.current():
        backend = str(dist.get_backend())
        try:
            side = _side_group(backend, timeout)
        except (RuntimeError, ValueError) as exc:
            raise _translate(exc, "new_group(gloo)", info) from exc
        _state = _remember(side)
    return info


def gloo_group() -> ProcessGroup:
    """The process group for CPU collectives: the gloo side group when the default
    group runs NCCL, else the default group.

    Raises:
        LaunchError: torch.distributed was not brought up by :func:`init_process_group`.
    """
    import torch.distributed as dist

    if _state is None or not _state.current():
        raise LaunchError(
            "torch.distributed is not initialised by launch.init_process_group(); call it first",
            variable="",
            value="",
        )
    group = _state.side_group() if _state.side_group is not None else dist.group.WORLD
    assert group is not None  # alive while the world is: destroy_process_group drops both
    return group
