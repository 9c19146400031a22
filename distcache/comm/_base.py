"""The Communicator seam: the few collectives distcache's policy needs.

Backends (mpi4py, torch.distributed, in-process) implement :class:`Communicator`;
every policy above the seam (prefetch, the IPC registry, error agreement) is written
once against it. Every blocking call takes ``timeout`` (seconds; ``None`` means the
communicator's default) and raises :class:`~distcache.errors.CollectiveTimeout`
instead of hanging.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from distcache import errors
from distcache.comm._codec import encode
from distcache.config import check_seconds
from distcache.errors import ConfigError, DistcacheError, RemoteError, WireError

#: No single message may exceed this: MPI counts are 32-bit and several transports
#: misbehave at 2**31 bytes.
MAX_MESSAGE_BYTES = (2 << 30) - 1


@runtime_checkable
class Communicator(Protocol):
    """What a collective needs from a process group, and nothing more."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def node_id(self) -> str:
        """Identity of the node this rank runs on (hostname or ``DISTCACHE_NODE_ID``)."""
        ...

    @property
    def backend(self) -> str:
        """``"mpi"``, ``"torch"``, ``"local"`` or ``"threads"``."""
        ...

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        """Return ``root``'s ``data`` on every rank (``data`` is ignored elsewhere).

        Payloads larger than the chunk size are sent in chunks.

        Raises:
            CollectiveTimeout: not every rank arrived in time.
            CommError: the backend failed.
            ValueError: ``root`` is out of range, or ``data`` is None on ``root``.
        """
        ...

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's small ``obj``, in rank order: plain data only (None, bool, int,
        float, str, bytes, lists, tuples, dicts with str or int keys; see
        :mod:`distcache.comm._codec`), never a pickle.

        Raises:
            CollectiveTimeout: not every rank arrived in time.
            CommError: the backend failed.
            WireError: ``obj`` is not plain data (on this rank, before it sends), or
                a peer's payload is not one (naming the peer).
        """
        ...

    def barrier(self, *, timeout: float | None = None) -> None:
        """Wait for every rank.

        Raises:
            CollectiveTimeout: not every rank arrived in time.
        """
        ...

    def split(self, color: int) -> Communicator:
        """A sub-communicator of the ranks that passed the same ``color`` (collective).

        Raises:
            CollectiveTimeout: not every rank arrived in time.
        """
        ...


class Wrapping:
    """The identity of a communicator that wraps another, ``_base``: its rank, size,
    node and backend, read through (a counting wrapper, the node tree)."""

    _base: Communicator

    @property
    def rank(self) -> int:
        return self._base.rank

    @property
    def size(self) -> int:
        return self._base.size

    @property
    def node_id(self) -> str:
        return self._base.node_id

    @property
    def backend(self) -> str:
        return self._base.backend

    @property
    def base(self) -> Communicator:
        """The wrapped communicator."""
        return self._base


class Forwarding(Wrapping):
    """A :class:`Wrapping` that reads the wrapped communicator's options through
    (``timeout``, ``chunk_bytes``, ``split_owned``, ``mpi_comm``) and its ``usable``.
    ``broadcast_buffer`` is not read through: a subclass defines its own over
    :func:`lend_broadcast`, so that a lent buffer goes through the wrapper too. Nor
    is ``group_owned``: a child made by the wrapped communicator would not go
    through the wrapper; a subclass that wraps its children defines it."""

    @property
    def usable(self) -> bool:
        return bool(getattr(self._base, "usable", True))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("broadcast_buffer", "group_owned"):
            raise AttributeError(name)
        return getattr(self._base, name)


def hostname() -> str:
    return os.uname().nodename  # gethostname(), without loading the socket module


def check_broadcast(rank: int, size: int, root: int, data: bytes | bytearray | None) -> None:
    """The argument checks every ``broadcast_bytes`` makes before it communicates.

    Raises:
        ValueError: ``root`` is out of range, or ``data`` is None on ``root``.
    """
    if not 0 <= root < size:
        raise ValueError(f"root {root} is out of range for a communicator of size {size}")
    if rank == root and data is None:
        raise ValueError("broadcast_bytes: the root rank must pass data")


def check_timeout(timeout: float | None) -> None:
    """The check every collective makes of its ``timeout`` before it communicates.

    Raises:
        ValueError: ``timeout`` is not None and not seconds that
            :func:`~distcache.config.check_seconds` takes (in its words).
    """
    if timeout is not None:
        try:
            check_seconds(timeout, what="timeout", text=False)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None


def lend_broadcast(comm: Communicator, data: bytearray | None, root: int, *,
                   timeout: float | None = None) -> bytes | bytearray:
    """Broadcast bulk ``data`` from ``root`` without the copies ``broadcast_bytes`` makes
    where ``comm`` offers ``broadcast_buffer`` (distcache's own communicators do): the
    root lends ``data`` and must not change it afterwards. Any other communicator gets
    a plain ``broadcast_bytes``."""
    lend = getattr(comm, "broadcast_buffer", None)
    if lend is not None:
        received: bytes | bytearray = lend(data, root, timeout=timeout)
        return received
    return comm.broadcast_bytes(None if data is None else bytes(data), root, timeout=timeout)


def chunk_spans(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` spans that cover ``total`` bytes in pieces of at most ``chunk``."""
    if chunk <= 0:
        raise ValueError(f"chunk size must be > 0, got {chunk}")
    if total == 0:
        return
    for start in range(0, total, chunk):
        yield start, min(start + chunk, total)


def agree_on_error(
    comm: Communicator, error: BaseException | None, *, timeout: float | None = None,
    carry: Any = None,
) -> list[Any]:
    """Collective: if any rank passes an error, every rank raises one; else every
    rank's ``carry`` (plain data), in rank order: what the ranks tell each other next
    rides on the same all-gather. A failed rank re-raises its own error (``agreed``
    where all are described alike); any other raises the lowest failing rank's, rebuilt
    (:func:`described_error`): data, never a pickle.

    Raises:
        DistcacheError: some rank failed.
        CollectiveTimeout: not every rank arrived in time.
        WireError: a peer's description is not one (the error names the peer).
    """
    payload = None if error is None else describe_error(error)
    gathered = comm.allgather_object((comm.node_id, payload, carry), timeout=timeout)
    failures = []
    for rank, entry in enumerate(gathered):
        if not (type(entry) is tuple and len(entry) == 3 and type(entry[0]) is str):
            raise _bad_description(comm, rank, "not a (node id, description, carry) triple")
        if entry[1] is not None:
            failures.append((rank, entry[0], entry[1]))
    if not failures:
        return [entry[2] for entry in gathered]
    if error is not None:
        if isinstance(error, DistcacheError) and len(failures) == comm.size:
            error.agreed = all(f[2] == payload for f in failures) or error.agreed
        raise error
    rank, host, description = failures[0]
    rebuilt = described_error(description, rank, comm.size, host)
    if isinstance(rebuilt, str):
        raise _bad_description(comm, rank, rebuilt)
    raise rebuilt


def described_error(description: Any, rank: int, size: int, host: str
                    ) -> DistcacheError | str:
    """The error rank ``rank`` of ``size`` on ``host`` described (:func:`describe_error`),
    as its class of distcache's, else a :class:`RemoteError` naming the rank, its host
    and the message; or what is wrong with ``description``."""
    if not (type(description) is tuple and len(description) == 4
            and all(type(part) is str for part in description[:2])):
        return "not an error's description"
    type_name, text, kind, attrs = description
    if kind is None:
        return RemoteError(f"rank {rank}/{size} on {host} failed with {type_name}: {text}",
                           rank=rank, host=host, remote_type=type_name)
    rebuilt = rebuild_error(kind, text, attrs)
    return f"an error of unknown class {kind!r}" if rebuilt is None else rebuilt


#: The classes an error may be rebuilt as on another rank: distcache's own tree.
_WIRE_ERRORS: dict[str, type[DistcacheError]] = {
    name: getattr(errors, name) for name in errors.__all__
}


def describe_error(error: BaseException) -> tuple[str, str, str | None, dict[str, Any]]:
    """``error`` as plain data: ``(type name, message, class to rebuild, attributes)``.

    The class to rebuild is the nearest class of :mod:`distcache.errors` ``error``
    derives from (None for any other error); the attributes are those it declares,
    each as itself when it is plain data, else as its ``str``.
    """
    kind = next((k for k in type(error).__mro__ if _WIRE_ERRORS.get(k.__name__) is k), None)
    attrs: dict[str, Any] = {}
    if kind is not None:
        assert issubclass(kind, DistcacheError)  # every class of the tree is one
        for name in sorted(kind.declared()):
            value = getattr(error, name, None)
            try:
                encode(value)
            except WireError:
                value = str(value)
            attrs[name] = value
    text = error.message if isinstance(error, DistcacheError) else str(error)
    return (type(error).__name__, text, None if kind is None else kind.__name__, attrs)


def rebuild_error(kind: Any, text: str, attrs: Any) -> DistcacheError | None:
    """The error of class ``kind`` (a name from :mod:`distcache.errors`) that
    :func:`describe_error` described, or None when ``kind`` names no such class.
    Attributes the class does not declare are dropped."""
    cls = _WIRE_ERRORS.get(kind) if type(kind) is str else None
    if cls is None:
        return None
    declared = cls.declared()
    given = attrs if type(attrs) is dict else {}
    return cls(text, **{k: v for k, v in given.items() if k in declared})


def _bad_description(comm: Communicator, peer: int, what: str) -> WireError:
    return WireError(
        f"agree_on_error on rank {comm.rank}/{comm.size} ({comm.node_id}): what rank "
        f"{peer} sent is {what}; check that every rank runs the same distcache",
        op="agree_on_error", rank=comm.rank, backend=comm.backend, peer=peer,
    )


# Polling: a tight loop first (small collectives finish in microseconds), a short
# sleep next (idle ranks leave the cores to working ones), then a tenth of the time
# waited so far; the first and longest pauses follow how many processes share each
# core (:func:`_shortest_pause`, :func:`_longest_pause`). A rank waiting seconds polls
# a few dozen times, and completes at most about 10 % later than it could have.
_POLL_MIN_S, _POLL_MAX_S, _POLL_LONG_S = 20e-6, 2e-3, 50e-3
#: The longest pause where each process of the host has a core of its own.
_POLL_OWN_CORE_S = 5e-3
#: Variables the launchers set to the number of processes on this host.
_LOCAL_PROCESSES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS",
                    "SLURM_NTASKS_PER_NODE")


@functools.cache
def _processes_per_core() -> float | None:
    """This host's processes (the launcher's count) per usable core, at least 1; None
    where no launcher says."""
    local = next((os.environ[v] for v in _LOCAL_PROCESSES if os.environ.get(v)), "")
    if not (local.isascii() and local.isdigit() and int(local) > 0):
        return None
    return max(1.0, int(local) / usable_cpus())


def _longest_pause() -> float:
    """:data:`_POLL_OWN_CORE_S` times the processes per core, at most (and on a host
    of unknown load) :data:`_POLL_LONG_S`: where every rank has a core, polling often
    costs nothing a working rank needs and a wait ends closer to its peers' arrival."""
    per_core = _processes_per_core()
    return _POLL_LONG_S if per_core is None else min(_POLL_LONG_S, _POLL_OWN_CORE_S * per_core)


def _shortest_pause() -> float:
    """A wait's first pause: :data:`_POLL_MIN_S` times the processes per core, at most
    :data:`_POLL_MAX_S`. A rank that outnumbers the cores is not run again sooner for
    sleeping less; it only wakes more often, on CPU the working ranks wait for."""
    per_core = _processes_per_core()
    return _POLL_MIN_S if per_core is None else min(_POLL_MAX_S, _POLL_MIN_S * per_core)


#: Where Linux says which cores this process's control group may run on (cgroup v2,
#: then v1: "0-3,8") and its CPU time per period (v2's ``cpu.max``, else v1's).
CGROUP_CPU = (("/sys/fs/cgroup/cpuset.cpus.effective",
               "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"),
              "/sys/fs/cgroup/cpu.max",
              ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def usable_cpus(cgroup: Any = CGROUP_CPU) -> float:
    """The cores this host's processes of the job may use: the control group's cores
    (a container's CPU set; else the host's), at most its CPU quota (a container's
    limit, in cores, fractional), at least one. Not this process's own affinity: a
    launcher that binds each rank to a core gives each an affinity of one core, and its
    ranks still have a core each. ``os.cpu_count()`` alone counts the host's cores,
    which a container limited to a few of them does not get."""
    (cpusets, v2, (quota_file, period_file)) = cgroup
    cores = float(os.cpu_count() or 1)
    for path in cpusets:
        listed = _cpu_list_size(_read(path))
        if listed:
            cores = min(cores, float(listed))
            break
    text = _read(v2)
    quota, _, period = (text or "").partition(" ")
    if text is None:
        quota, period = _read(quota_file) or "", _read(period_file) or ""
    try:
        limit = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):  # "max", none, or unreadable: no quota
        limit = 0.0
    return max(1.0, min(cores, limit) if limit > 0 else cores)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_list_size(text: str | None) -> int:
    """How many cores a Linux CPU list ("0-3,8,10-11") names; 0 when it is not one."""
    count = 0
    try:
        for part in (text or "").split(","):
            first, dash, last = part.partition("-")
            span = (int(last) if dash else int(first)) - int(first) + 1
            if span < 1:
                return 0
            count += span
    except ValueError:
        return 0
    return count


def poll_until(done: Callable[[], bool], until: float) -> bool:
    """Call ``done`` until it returns True (then True) or ``until`` passes (False)."""
    pause = _shortest_pause()
    longest = _longest_pause()
    began = time.monotonic()
    while not done():
        now = time.monotonic()
        if not now < until:  # a NaN deadline has passed too
            return False
        time.sleep(min(pause, until - now))
        if pause < _POLL_MAX_S:
            pause = min(pause * 2, _POLL_MAX_S)
        else:
            pause = min(max(_POLL_MAX_S, (now - began) * 0.1), longest)
    return True
