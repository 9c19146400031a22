"""The torch.distributed backend (gloo on CPU, NCCL on CUDA).

Every collective is issued with ``async_op=True`` and waited with a timeout, so a rank
that never arrives makes its peers raise :class:`~distcache.errors.CollectiveTimeout`
instead of blocking until the process group's own (long) timeout. A backend that takes a
timeout per operation (distcache's own gloo group) is also given what is left of the
call's budget where that is longer than the communicator's timeout, so a call given
longer than the group's timeout gets it. A collective that timed out may still be queued in the backend and cannot be
cancelled, so the communicator refuses further calls afterwards; build a new one to
continue.

On NCCL, tensors live on the current CUDA device (NCCL moves only device memory); on
every other backend they stay on the CPU. The policy (chunking, the wire form, split's
child cache) is :class:`~distcache.comm._backend.BackendCommunicator`'s; this module
moves tensors. torch is imported in the constructor, never at module import.
"""

from __future__ import annotations

import atexit
import math
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self

from distcache._log import get_logger
from distcache.comm._backend import BackendCommunicator, Budget
from distcache.comm._base import MAX_MESSAGE_BYTES, poll_until
from distcache.errors import CommError

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

# Substrings by which torch reports a timed-out wait, matched in lower case (gloo says
# "Timed out waiting 3000ms", torch "Wait timeout"). torch raises plain RuntimeError (or
# DistBackendError, a RuntimeError) for both timeouts and broken connections.
_TIMEOUT_MARKERS = ("timed out", "timeout")


def _is_timeout(exc: BaseException) -> bool:
    """Whether torch's ``exc`` reports a timeout (rather than, say, a lost peer)."""
    text = str(exc).lower()
    return any(marker in text for marker in _TIMEOUT_MARKERS)


# Every live communicator, so that their process groups can be let go at exit.
_live: weakref.WeakSet[TorchCommunicator] = weakref.WeakSet()


def _release_groups() -> None:
    """Drop every communicator's reference to its process group (an ``atexit`` hook).

    A group that outlives ``destroy_process_group()`` only because a communicator
    still holds it would otherwise be destroyed while the interpreter finalizes:
    gloo's worker threads, which have run Python code (freeing tensors), then exit
    when no thread may take the GIL any more, and the process dies in
    ``std::terminate`` after the program has finished. Exit hooks run before that.
    """
    for comm in list(_live):
        comm._release("the interpreter exited")


atexit.register(_release_groups)


def import_torch() -> tuple[Any, Any]:
    """``(torch, torch.distributed)``, or a :class:`CommError` saying what to install."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise CommError(
            f"torch.distributed is not importable: {exc}", op="init", backend="torch"
        ) from exc
    return torch, dist


#: Padding an all-gather may add beyond twice the bytes it carries (see padded_width).
PAD_ALLOWANCE = 64 << 10


def padded_width(lengths: list[int]) -> int:
    """The width every part of an all-gather is padded to: the longest part whose
    width over every rank stays within twice the parts' total plus
    :data:`PAD_ALLOWANCE`. Longer parts are broadcast one by one, so what a rank holds
    for one all-gather is at most about three times what it receives."""
    limit = 2 * sum(lengths) + PAD_ALLOWANCE
    fits = [n for n in lengths if n * len(lengths) <= limit]
    return max(fits, default=0)


class TorchCommunicator(BackendCommunicator):
    """A :class:`~distcache.comm._base.Communicator` over a torch.distributed group.

    Args:
        group: a ``ProcessGroup`` (default: the world group).
        timeout: default seconds per collective (default ``DISTCACHE_TIMEOUT``).
        chunk_bytes: largest single broadcast message (default ``DISTCACHE_CHUNK_BYTES``).
        node_id: this rank's node identity (default ``DISTCACHE_NODE_ID``, else the
            hostname).

    Raises:
        CommError: torch.distributed is unavailable or not initialised, or this
            process is not a member of ``group``.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
        ValueError: ``timeout`` or ``chunk_bytes`` is out of range.
    """

    _kind = "torch"
    _label = "torch"
    #: The timeout of the collective :meth:`_run` is starting: what is left of its
    #: call's budget, for the ``_start_*`` of a backend that takes one per operation.
    _op_timeout: timedelta

    def __init__(
        self,
        group: Any = None,
        *,
        timeout: float | None = None,
        chunk_bytes: int | None = None,
        node_id: str | None = None,
    ) -> None:
        torch, dist = import_torch()
        if not dist.is_available() or not dist.is_initialized():
            raise CommError(
                "torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() (or launch.init_process_group()) first",
                op="init",
                backend="torch",
            )
        group = dist.group.WORLD if group is None else group
        self._setup(torch, dist, group, dist.get_rank(group), dist.get_world_size(group),
                    str(dist.get_backend(group)), timeout=timeout, chunk_bytes=chunk_bytes,
                    node_id=node_id)

    def _setup(
        self, torch: Any, dist: Any, group: Any, rank: int, size: int, backend: str,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self._torch = torch
        self._dist = dist
        self._group: Any = group
        self._rank = rank
        self._size = size
        if self._rank < 0:
            raise CommError(
                "this process is not a member of the given process group",
                op="init",
                backend="torch",
            )
        self._backend_name = backend
        if self._backend_name == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        _live.add(self)

    def _release(self, why: str) -> None:
        """Let go of the process group; every later call raises :class:`CommError`."""
        self._group = None
        self._broken = self._broken or why
        self._children.clear()

    # -- issuing one collective (a subclass may issue on a group torch does not know) --
    # torch's functions take no per-operation timeout: on a group of the engine's, an
    # operation keeps that group's timeout (the wait in _run still bounds the call).

    def _start_broadcast(self, tensor: Any, root: int) -> Any:
        return self._dist.broadcast(tensor, self._global(root), group=self._group, async_op=True)

    def _start_allgather(self, outs: list[Any], tensor: Any) -> Any:
        return self._dist.all_gather(outs, tensor, group=self._group, async_op=True)

    def _start_allreduce(self, tensor: Any) -> Any:
        return self._dist.all_reduce(tensor, group=self._group, async_op=True)

    @property
    def group(self) -> Any:
        """The wrapped ``torch.distributed`` process group."""
        return self._group

    @property
    def device(self) -> torch.device:
        """Where this communicator's tensors live (CUDA on NCCL, else CPU)."""
        return self._device

    def _repr_extra(self) -> str:
        return f"backend={self._backend_name!r}, "

    # -- one collective: start, then wait within the budget ---------------------------

    def _run(self, op: str, budget: Budget, start: Any, *args: Any, **kwargs: Any) -> None:
        """Issue one async collective and wait for it within what is left of the call's
        ``budget`` (a call of many chunks or rounds takes its timeout once, not once
        per chunk), translating torch's errors."""
        wait = budget.until - time.monotonic()
        if wait <= 0:
            raise self._timed_out(op, budget.seconds)
        # Never shorter than the communicator's own timeout: an operation the call gives
        # up on stays queued (a late rank completes it, as on MPI) rather than broken
        # in the group by the backend; a call given longer gets longer. Whole
        # milliseconds, rounded up: gloo reads a timeout of 0 ms as "none".
        self._op_timeout = timedelta(milliseconds=math.ceil(max(wait, self._timeout) * 1000))
        try:
            work = start(*args, **kwargs)
            if self._device.type == "cpu":
                work.wait(timeout=timedelta(seconds=wait))
            else:
                self._poll(work, wait)
        except RuntimeError as exc:  # DistBackendError, DistError are RuntimeErrors
            if _is_timeout(exc):
                raise self._timed_out(op, budget.seconds) from exc
            self._broken = f"{op} failed"
            raise self._comm_error(op, exc, over=self._backend_name) from exc

    @staticmethod
    def _poll(work: Any, wait: float) -> None:
        # On NCCL, Work.wait() only makes the current CUDA stream wait; the host would
        # then block, with no bound, on the first read of the result. Polling the
        # work's completion bounds the host-side wait instead.
        if not poll_until(work.is_completed, time.monotonic() + wait):
            raise RuntimeError(f"collective timed out after {wait:g} s (polled)")
        work.wait()

    def _bytes_tensor(self, data: bytes | bytearray, *, lend: bool = False) -> torch.Tensor:
        """``data`` as a uint8 tensor on this group's device; with ``lend``, a
        bytearray is used in place on the CPU (the tensor keeps it alive)."""
        torch = self._torch
        if len(data) == 0:
            return torch.empty(0, dtype=torch.uint8, device=self._device)
        buffer = data if lend and isinstance(data, bytearray) else bytearray(data)
        tensor = torch.frombuffer(buffer, dtype=torch.uint8)
        return tensor.to(self._device) if self._device.type != "cpu" else tensor

    def _to_host(self, tensor: torch.Tensor) -> bytearray:
        """One copy of ``tensor`` into a bytearray of its own."""
        host = bytearray(tensor.numel())
        if host:
            self._torch.frombuffer(host, dtype=self._torch.uint8).copy_(tensor)
        return host

    def _to_bytes(self, tensor: torch.Tensor) -> bytes:
        return bytes(self._to_host(tensor))

    def _global(self, rank: int) -> int:
        return int(self._dist.get_global_rank(self._group, rank))

    # -- transport primitives ---------------------------------------------------------

    def _broadcast_block(self, block: bytes | None, width: int, root: int,
                         budget: Budget) -> bytearray:
        tensor = (self._torch.empty(width, dtype=self._torch.uint8, device=self._device)
                  if block is None else self._bytes_tensor(block))
        self._run("broadcast_bytes", budget, self._start_broadcast, tensor, root)
        return self._to_host(tensor)

    def _payload_buffer(self, data: bytes | None, total: int) -> torch.Tensor:
        if data is not None:
            return self._bytes_tensor(data)
        return self._torch.empty(total, dtype=self._torch.uint8, device=self._device)

    def _broadcast_span(
        self, buffer: torch.Tensor, start: int, stop: int, root: int, budget: Budget
    ) -> None:
        # A slice of a contiguous 1-D tensor is contiguous: broadcast in place.
        span = buffer[start:stop]
        self._run("broadcast_bytes", budget, self._start_broadcast, span, root)

    def _buffer_bytes(self, buffer: torch.Tensor) -> bytes:
        return self._to_bytes(buffer)

    def _lent_buffer(self, data: bytes | bytearray | None, total: int) -> torch.Tensor:
        # The root's bytearray is sent in place on the CPU; a device gets its one copy.
        if data is None:
            return self._payload_buffer(None, total)
        return self._bytes_tensor(data, lend=True)

    def _owned_buffer(self, buffer: torch.Tensor) -> bytearray:
        return self._to_host(buffer)

    def _allgather_blocks(self, block: bytes, budget: Budget) -> list[bytearray]:
        mine = self._bytes_tensor(block)
        parts = [self._torch.empty_like(mine) for _ in range(self._size)]
        self._run("allgather_object", budget, self._start_allgather, parts, mine)
        return [self._to_host(part) for part in parts]

    def _allgather_payloads(self, mine: bytes, lengths: list[int], budget: Budget) -> list[bytes]:
        longest = max(lengths)
        if longest > MAX_MESSAGE_BYTES:
            raise self._too_large(
                f"an encoded object of {longest} bytes exceeds one message ({MAX_MESSAGE_BYTES})"
            )
        # all_gather needs equal shapes. Parts up to ``width`` travel in one all_gather
        # padded to it; each longer one is broadcast by its rank, so no rank allocates
        # ``size x longest`` for one long part among short ones (see padded_width).
        torch = self._torch
        width = padded_width(lengths)
        padded = torch.zeros(max(width, 1), dtype=torch.uint8, device=self._device)
        if mine and len(mine) <= width:
            padded[: len(mine)] = self._bytes_tensor(mine)
        parts = [torch.empty_like(padded) for _ in range(self._size)]
        self._run("allgather_object", budget, self._start_allgather, parts, padded)
        out = [self._to_bytes(part[:n]) if n <= width else b""
               for part, n in zip(parts, lengths, strict=True)]
        del parts, padded
        for rank, n in enumerate(lengths):
            if n > width:
                tensor = (self._bytes_tensor(mine) if rank == self._rank else
                          torch.empty(n, dtype=torch.uint8, device=self._device))
                self._run("allgather_object", budget, self._start_broadcast, tensor,
                          rank)
                out[rank] = self._to_bytes(tensor)
        return out

    def _barrier(self, budget: Budget) -> None:
        # dist.barrier() takes no timeout on most backends; an all-reduce of one
        # element waited with a timeout is a barrier that can give up.
        token = self._torch.zeros(1, dtype=self._torch.int32, device=self._device)
        self._run("barrier", budget, self._start_allreduce, token)

    def _split_child(self, colors: tuple[int, ...], color: int) -> Self:
        dist = self._dist
        timeout = timedelta(seconds=self._timeout)
        try:
            if self._size == dist.get_world_size():
                # new_group names groups by a per-process counter, so every rank of the
                # job must create every group, in the same order, to keep names in step.
                mine = None
                for each in sorted(set(colors)):
                    ranks = [self._global(r) for r, c in enumerate(colors) if c == each]
                    made = dist.new_group(ranks, timeout=timeout)
                    if each == color:
                        mine = made
            else:
                # Ranks outside this group will not call new_group; hashed names let
                # only the members synchronise (the groups made here are disjoint).
                members = [self._global(r) for r, c in enumerate(colors) if c == color]
                mine = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
        except RuntimeError as exc:
            raise self._comm_error("split", exc) from exc
        return type(self)(mine, **self._inherited())
