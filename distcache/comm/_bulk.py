"""Bulk bytes over one transport, everything else over another.

``init(transport="nccl")`` moves the prefetch's artifact bytes over a dedicated NCCL
group made for the prefetch and closed after it; the control plane (the small
all-gathers, barriers and agreements) stays on distcache's own MPI or gloo
communicator, where timeouts can be bounded on the host. The NCCL group meets on a
store rank 0 hosts on a port the OS chooses, listening on the address it publishes
only (:func:`launch.publish_store`); its address travels over the control
communicator, so nothing races for a port and no launcher variable is needed. The
group meets under the control communicator's run scope where it has one, else under a
scope agreed on that fresh store.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from distcache._log import get_logger
from distcache.comm._base import Communicator, agree_on_error, lend_broadcast
from distcache.errors import CommError, ConfigError, DistcacheError

if TYPE_CHECKING:
    from distcache.comm._scope import RunScope

log = get_logger(__name__)


class BulkCommunicator:
    """A :class:`Communicator` whose ``broadcast_bytes`` runs on ``bulk`` and whose
    other collectives run on ``control``; ``split`` splits both alike."""

    def __init__(self, control: Communicator, bulk: Communicator) -> None:
        if (control.rank, control.size) != (bulk.rank, bulk.size):
            raise CommError(
                f"control ({control.rank}/{control.size}) and bulk ({bulk.rank}/{bulk.size}) "
                "communicators must span the same ranks in the same order",
                op="init", rank=control.rank,
            )
        self.control = control
        self.bulk = bulk

    @property
    def rank(self) -> int:
        return self.control.rank

    @property
    def size(self) -> int:
        return self.control.size

    @property
    def node_id(self) -> str:
        return self.control.node_id

    @property
    def backend(self) -> str:
        return f"{self.control.backend}+{self.bulk.backend}"

    @property
    def scope(self) -> RunScope | None:
        """The control communicator's run scope, where it has one."""
        found: RunScope | None = getattr(self.control, "scope", None)
        return found

    def broadcast_bytes(self, data: bytes | None, root: int, *,
                        timeout: float | None = None) -> bytes:
        return self.bulk.broadcast_bytes(data, root, timeout=timeout)

    def broadcast_buffer(self, data: bytearray | None, root: int, *,
                         timeout: float | None = None) -> bytes | bytearray:
        return lend_broadcast(self.bulk, data, root, timeout=timeout)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return self.control.allgather_object(obj, timeout=timeout)

    def barrier(self, *, timeout: float | None = None) -> None:
        self.control.barrier(timeout=timeout)

    def split(self, color: int) -> BulkCommunicator:
        return BulkCommunicator(self.control.split(color), self.bulk.split(color))

    def __repr__(self) -> str:
        return f"BulkCommunicator(control={self.control!r}, bulk={self.bulk!r})"


def shared_store(comm: Communicator, timeout: float) -> Any:
    """A ``TCPStore`` every rank of ``comm`` reaches: rank 0 hosts it on a port the OS
    chooses and the address travels over ``comm`` (:func:`launch.publish_store`).
    Collective: every rank learns whether every other one reached the store, so rank 0
    does not wait for peers that never will.

    Raises:
        CommError: the store cannot be hosted or reached, or rank 0's address is
            malformed (on every rank alike: the lowest failing rank's error).
    """
    from datetime import timedelta

    from launch import publish_store

    wait = timedelta(seconds=timeout)
    store: Any = None
    error: CommError | None = None
    try:
        _, _, store = publish_store(
            comm.rank, comm.size,
            lambda obj: comm.allgather_object(obj, timeout=timeout),
            lambda obj: _address(comm, comm.allgather_object(obj, timeout=timeout)[0]),
            wait,
        )
    except CommError as exc:
        error = exc
    except (RuntimeError, ValueError) as exc:
        error = CommError(f"rank {comm.rank}: cannot reach the NCCL group's store: {exc}",
                          op="rendezvous", rank=comm.rank, backend="nccl")
        error.__cause__ = exc
    agree_on_error(comm, error, timeout=timeout)
    return store


def _address(comm: Communicator, message: Any) -> tuple[str, str, int]:
    """Rank 0's ``(status, host or reason, port)`` for the store, checked for its shape
    before this rank connects to it.

    Raises:
        CommError: it is not such a triple with a port in 1-65535 when the status is
            "ok" (naming rank 0, which sent it).
    """
    if type(message) is tuple and len(message) == 3:
        status, host, port = message
        if type(status) is str and type(host) is str and type(port) is int and (
                status != "ok" or (host and 1 <= port <= 65535)):
            return status, host, port
    raise CommError(f"rank {comm.rank}: rank 0 sent a malformed address for the NCCL "
                    f"group's store: {message!r:.120}", op="rendezvous", rank=0,
                    backend="nccl")


@contextmanager
def bulk_transport(comm: Communicator, transport: str, timeout: float) -> Iterator[Communicator]:
    """The communicator a prefetch should run on for ``transport``: ``comm`` itself
    for ``"default"``; for ``"nccl"`` a :class:`BulkCommunicator` over a dedicated NCCL
    group made now and closed when the block ends. Collective.

    Raises:
        CommError: the NCCL group cannot be made (no CUDA, no NCCL, a peer missing);
            every rank learns of it through ``comm`` and raises alike.
        ConfigError: an unknown ``transport``.
    """
    if transport not in ("default", "nccl"):
        raise ConfigError(f"unknown transport {transport!r}; use 'default' or 'nccl' "
                          "(init(transport=...) or DISTCACHE_TRANSPORT)",
                          variable="DISTCACHE_TRANSPORT", value=transport)
    if transport == "default" or comm.size == 1:
        yield comm
        return
    # torch's NCCL group (and torch) is loaded for this transport only.
    from distcache.comm._gloo import NcclCommunicator

    bulk = None
    error: BaseException | None = None
    scope: RunScope | None = getattr(comm, "scope", None)
    try:
        bulk = NcclCommunicator(shared_store(comm, timeout), comm.rank, comm.size,
                                scope=scope, prefix=None if scope is None else scope.key("nccl"),
                                run=("", 0), timeout=timeout, node_id=comm.node_id)
    except DistcacheError as exc:
        error = exc
    try:
        agree_on_error(comm, error, timeout=timeout)
    except BaseException:
        if bulk is not None:  # made here, but another rank failed: let it go
            bulk.close()
        raise
    assert bulk is not None  # agree_on_error raised otherwise
    log.debug("prefetch bytes move over %r", bulk)
    try:
        yield BulkCommunicator(comm, bulk)
    finally:
        bulk.close()
