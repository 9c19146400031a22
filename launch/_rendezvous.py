"""A key-value store every rank of the job can reach, found without any collective.

distcache's private gloo groups rendezvous here, never on the engine's process group:

* the engine already initialised torch.distributed over the launcher's ranks -- its
  default store, under a prefix of distcache's own (reading the store is not a
  collective on the group); an engine's world of its own (one per replica) is not the
  job's, and the launcher's store below serves instead;
* torchrun -- the agent's store at ``MASTER_ADDR:MASTER_PORT``
  (``TORCHELASTIC_USE_AGENT_STORE=True``): every rank is a client, so the engine's own
  ``env://`` rendezvous later finds the port as it expects;
* Slurm ``srun`` or ``python -m launch`` -- rank 0 hosts a store one port above
  ``MASTER_PORT``, so the engine's ``env://`` rendezvous on ``MASTER_PORT`` itself stays
  free for the engine.

Under MPI distcache uses a duplicate of the MPI world instead and needs no store.

A store distcache hosts (:func:`host_store`) listens on the address the launcher names
(``MASTER_ADDR``, the step's first node), not on every interface: torch's
``TCPStore`` binds its server to every interface whatever ``host_name`` says
(``host_name`` only tells clients where to connect), so distcache binds the socket
itself and hands it over (``master_listen_fd``). Where that address is loopback but the
job spans hosts (a host name that resolves to ``127.0.1.1`` on its own host), or is not
an address of this host at all, the store listens on every interface, as torch's does.
The store has no authentication: whoever reaches the port can read and write its keys.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from distcache._log import get_logger
from distcache.errors import CommError, LaunchError
from launch._detect import SLURM_PORT_LOW, LaunchInfo

log = get_logger(__name__)

#: Offset from ``MASTER_PORT`` of the store rank 0 hosts when no agent hosts one.
PORT_OFFSET = 1


@dataclass(frozen=True)
class Rendezvous:
    """A store shared by the job's ranks, and this process's place among them."""

    store: Any
    rank: int
    world_size: int
    #: Where the store came from, for logs: "default group", "torchrun agent", ...
    source: str
    #: This rank is a client of a store another process's rank 0 hosts for one
    #: adoption: the server on that port may be an earlier adoption's, closing.
    replaceable: bool = False


def find_store(
    info: LaunchInfo, timeout: float, environ: Mapping[str, str] | None = None
) -> Rendezvous:
    """The job's rendezvous store, reached without a collective on any group.

    The engine's default store serves where torch.distributed is initialised and its
    rank and world size are the launcher's (or no launcher started several ranks); an
    engine's world of its own (a group per replica) is not the job's, and the
    launcher's store and ranks serve instead.

    Raises:
        LaunchError: the launcher gives no address to meet at (no ``MASTER_ADDR`` /
            ``MASTER_PORT`` and no initialised torch.distributed), or ``MASTER_PORT`` is
            the last port, with none above it for the store rank 0 hosts.
        CommError: the store cannot be reached or hosted within ``timeout``.
    """
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    wait = timedelta(seconds=timeout)
    engine = ""
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        place = (dist.get_rank(), dist.get_world_size())
        if info.world_size == 1 or place == (info.rank, info.world_size):
            return Rendezvous(distributed_c10d._get_default_store(), *place,
                              "the engine's default store")
        # The engine made a world of its own (one per replica, ...): its store is not
        # shared by the launcher's ranks, and its ranks are not theirs.
        engine = (f"the engine's torch.distributed group says rank {place[0]} of "
                  f"{place[1]}, {info.launcher} says rank {info.rank} of {info.world_size}")
        log.info("rendezvous: %s; distcache meets on %s's ranks and store, not the engine's",
                 engine, info.launcher)
    if info.master_addr is None or info.master_port is None:
        raise LaunchError(
            f"{info.launcher} started {info.world_size} ranks but gives no rendezvous "
            "address" + (f" ({engine}, so its store is of no use)" if engine else "")
            + "; set MASTER_ADDR and MASTER_PORT (or launch under torchrun or mpirun)",
            variable="MASTER_ADDR", value=info.master_addr,
        )
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    port = info.master_port if agent else info.master_port + PORT_OFFSET
    if port > 65535:
        raise LaunchError(
            f"MASTER_PORT={info.master_port} leaves no port above it for distcache's "
            f"rendezvous store (MASTER_PORT + {PORT_OFFSET}); set MASTER_PORT to at most "
            f"{65535 - PORT_OFFSET}",
            variable="MASTER_PORT", value=str(info.master_port),
        )
    host_it = not agent and info.rank == 0
    if host_it:
        derived = "SLURM_JOB_ID" in info.source
        low, high = ephemeral_range()
        store = host_store(
            info.master_addr, port, info.world_size, wait, spans_hosts=not info.single_node,
            what=f"distcache's rendezvous store (MASTER_PORT {info.master_port} + {PORT_OFFSET})",
            hint=("the port was derived from SLURM_JOB_ID; set MASTER_PORT" if derived else
                  "set MASTER_PORT") + " to a port whose next port is free on rank 0's host "
                 f"too, below the ephemeral range ({low}-{high})",
        )
    else:
        try:
            store = client_store(info.master_addr, port, info.world_size, wait)
        except (RuntimeError, OSError) as exc:
            raise CommError(
                f"rank {info.rank}/{info.world_size}: cannot reach the rendezvous store at "
                f"{info.master_addr}:{port}: {exc}; check that rank 0 started and that the "
                "port is reachable from every node",
                op="rendezvous", rank=info.rank, backend="gloo",
            ) from exc
    source = "torchrun agent store" if agent else f"store hosted by rank 0 on port {port}"
    log.debug("rendezvous: %s at %s:%d", source, info.master_addr, port)
    return Rendezvous(store, info.rank, info.world_size, source,
                      replaceable=not agent and not host_it)


#: Linux's default ephemeral range (``net.ipv4.ip_local_port_range``), whose ports the
#: kernel hands to outgoing connections.
EPHEMERAL_LOW = 32768
EPHEMERAL_HIGH = 60999

#: Where Linux says which ephemeral range this host uses.
PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"

#: How many random candidates :func:`free_port_pair` tries before it gives up.
PORT_ATTEMPTS = 64

_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """``(low, high)`` of this host's ephemeral port range; Linux's default where
    :data:`PORT_RANGE_FILE` cannot be read (another OS) or makes no sense."""
    try:
        low, high = (int(field) for field in Path(PORT_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_LOW, EPHEMERAL_HIGH
    if not 1 <= low <= high <= 65535:
        return EPHEMERAL_LOW, EPHEMERAL_HIGH
    return low, high


def _port_spans(low: int, high: int) -> list[tuple[int, int]]:
    """Where a port ``P`` may lie so that ``P`` and ``P + PORT_OFFSET`` are both outside
    the ephemeral range ``[low, high]``: below it, from ``SLURM_PORT_LOW`` (or 1024 on a
    host whose range starts lower), else above it; the whole unprivileged range on a
    host that leaves no room outside (the bind check then still guards the choice)."""
    top = low - 1 - PORT_OFFSET
    if top >= SLURM_PORT_LOW:
        return [(SLURM_PORT_LOW, top)]
    spans = [(1024, top)] if top >= 1024 else []
    if high + 1 <= 65535 - PORT_OFFSET:
        spans.append((high + 1, 65535 - PORT_OFFSET))
    return spans or [(1024, 65535 - PORT_OFFSET)]


def _nth_port(spans: list[tuple[int, int]], index: int) -> int:
    for first, last in spans:
        if index <= last - first:
            return first + index
        index -= last - first + 1
    raise IndexError(index)


def _bindable(port: int) -> bool:
    """Whether a listener could take ``port`` just now on every interface, IPv4 and
    IPv6 (where the host has it): what torch's store and distcache's store may bind."""
    socks: list[socket.socket] = []
    try:
        for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError:
                continue  # no IPv6 on this host
            socks.append(sock)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((wildcard, port))
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL and family == socket.AF_INET6:
                    continue  # IPv6 disabled
                return False
        return True
    finally:
        for sock in socks:
            sock.close()


def free_port_pair(attempts: int = PORT_ATTEMPTS) -> int:
    """A port ``P`` for ``MASTER_PORT`` such that ``P`` (the program's own rendezvous)
    and ``P + PORT_OFFSET`` (the store distcache's rank 0 hosts, :func:`find_store`)
    are both outside the ephemeral range, where no outgoing connection takes them at
    random, and both free just now. Both are closed again before the program binds
    them: a small window another process could use, the price of the program owning
    its ports.

    Raises:
        LaunchError: ``attempts`` random candidates were all taken.
    """
    low, high = ephemeral_range()
    spans = _port_spans(low, high)
    total = sum(last - first + 1 for first, last in spans)
    tried: list[int] = []
    for _ in range(attempts):
        port = _nth_port(spans, _random.randrange(total))
        if _bindable(port) and _bindable(port + PORT_OFFSET):
            return port
        tried.append(port)
    where = " or ".join(f"{first}-{last}" for first, last in spans)
    raise LaunchError(
        f"no port P found for MASTER_PORT with P and P + {PORT_OFFSET} (distcache's store) "
        f"both free: {attempts} tries in {where} (the ephemeral range is {low}-{high}; "
        f"last tried: {', '.join(map(str, tried[-3:]))}); set MASTER_PORT to a free port "
        "whose next port is free on rank 0's host too",
        variable="MASTER_PORT", value="",
    )


def _listener(addr: str, port: int, spans_hosts: bool, what: str,
              hint: str) -> socket.socket | None:
    """A socket listening on ``addr:port`` only, or ``None`` where the store must
    listen on every interface (see the module docstring).

    Raises:
        CommError: the port is in use (``hint`` says what to do) or cannot be bound.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError) as exc:
        log.warning("%s: %r does not resolve on this host (%s); listening on every "
                    "interface", what, addr, exc)
        return None
    ip = str(sockaddr[0])
    if ipaddress.ip_address(ip.split("%")[0]).is_loopback and spans_hosts:
        log.info("%s: %r is %s on this host, which other hosts cannot reach; listening on "
                 "every interface", what, addr, ip)
        return None
    sock = socket.socket(family, kind, proto)
    try:
        # The port may have served the same purpose a moment ago (the launch wrapper's
        # store, then its program's), its connections still in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            log.warning("%s: %r (%s) is not an address of this host; listening on every "
                        "interface", what, addr, ip)
            return None
        raise _bind_error(addr, port, what, hint, exc) from exc
    return sock


def _bind_error(addr: str, port: int, what: str, hint: str, exc: BaseException) -> CommError:
    in_use = getattr(exc, "errno", None) == errno.EADDRINUSE or "in use" in str(exc).lower()
    why = f"port {port} is in use on this host" if in_use else f"the bind failed ({exc})"
    return CommError(f"cannot listen on {addr}:{port} for {what}: {why}; {hint}",
                     op="rendezvous", rank=0, backend="gloo")


def host_store(addr: str, port: int, size: int, timeout: timedelta, *, spans_hosts: bool,
               what: str, hint: str) -> Any:
    """Host a ``TCPStore`` server for ``size`` users on ``addr:port`` (``port`` 0: one
    the OS picks; read the store's ``port``), listening on ``addr`` only where torch
    allows it (see the module docstring).

    Raises:
        CommError: the port is in use or cannot be bound (the message names the port
            and says what to do, with ``hint``), or torch could not start the server.
    """
    import torch.distributed as dist

    sock = _listener(addr, port, spans_hosts, what, hint)
    try:
        if sock is None:
            return dist.TCPStore(addr, port, size, True, timeout=timeout,
                                 wait_for_workers=False)
        store = dist.TCPStore(addr, int(sock.getsockname()[1]), size, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except (RuntimeError, OSError) as exc:
        if sock is not None:
            sock.close()
        raise _bind_error(addr, port, what, hint, exc) from exc
    sock.detach()  # the server owns the descriptor now and closes it
    return store


def client_store(addr: str, port: int, size: int, timeout: timedelta) -> Any:
    """A ``TCPStore`` client of the server at ``addr:port``, within ``timeout`` in all.

    It waits for the server to listen itself (plain connects, a pause growing to half a
    second), then lets torch connect with what is left: torch's client, given the
    whole timeout, tries once more after a back-off when nothing answers, which took a
    rank whose rank 0 never came about twice the timeout (and printed a C++ trace for
    each try).

    Raises:
        TimeoutError: nothing listened at ``addr:port`` within ``timeout``.
        RuntimeError, OSError: torch's client failed (what it says).
    """
    import time

    import torch.distributed as dist

    until = time.monotonic() + timeout.total_seconds()
    pause = 0.02
    while True:
        left = until - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(left, 5.0))):
                break
        except OSError as exc:
            if left <= pause:
                raise TimeoutError(f"nothing listened at {addr}:{port} within "
                                   f"{timeout.total_seconds():.1f} s ({exc})") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
    left = max(1.0, until - time.monotonic())
    return dist.TCPStore(addr, port, size, False, timeout=timedelta(seconds=left))
