"""The torch.distributed backend (gloo on CPU, NCCL on CUDA).

Every collective is issued with ``async_op=True`` and waited with a timeout, so a rank
that never arrives makes its peers raise :class:`~distcache.errors.CollectiveTimeout`
instead of blocking until the process group's own (long) timeout. A collective that
timed out is still queued in the backend and cannot be cancelled, so the communicator
refuses further calls afterwards; build a new one to continue.

On NCCL, tensors live on the current CUDA device (NCCL moves only device memory); on
every other backend they stay on the CPU. torch is imported in the constructor, never
at module import.
"""

from __future__ import annotations

import logging
import pickle
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from distcache.comm.base import MAX_MESSAGE_BYTES, Communicator, chunk_spans, hostname
from distcache.config import settings
from distcache.errors import CollectiveTimeout, CommError

if TYPE_CHECKING:
    import torch

__all__ = ["TorchCommunicator"]

log = logging.getLogger(__name__)

# Substrings by which torch reports a timed-out wait. torch raises plain RuntimeError
# (or DistBackendError, a RuntimeError) for both timeouts and broken connections.
_TIMEOUT_MARKERS = ("timed out", "timeout", "Timeout")
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 2e-3


class TorchCommunicator:
    """A :class:`~distcache.comm.base.Communicator` over a torch.distributed group.

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

    def __init__(
        self,
        group: Any = None,
        *,
        timeout: float | None = None,
        chunk_bytes: int | None = None,
        node_id: str | None = None,
    ) -> None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            raise CommError(
                f"torch.distributed is not importable: {exc}", op="init", backend="torch"
            ) from exc
        if not dist.is_available() or not dist.is_initialized():
            raise CommError(
                "torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() (or launch.init_process_group()) first",
                op="init",
                backend="torch",
            )
        conf = settings(timeout=timeout, chunk_bytes=chunk_bytes, node_id=node_id)
        if not conf.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {conf.timeout}")
        if not 0 < conf.chunk_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"chunk_bytes must be between 1 and {MAX_MESSAGE_BYTES}")
        self._torch = torch
        self._dist = dist
        self._group: Any = dist.group.WORLD if group is None else group
        self._timeout = conf.timeout
        self._chunk_bytes = conf.chunk_bytes
        self._node_id = conf.node_id if conf.node_id is not None else hostname()
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        if self._rank < 0:
            raise CommError(
                "this process is not a member of the given process group",
                op="init",
                backend="torch",
            )
        self._backend_name = str(dist.get_backend(self._group))
        if self._backend_name == "nccl":
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        self._broken: str | None = None
        # split() results by the all-gathered colors (see split).
        self._children: dict[tuple[int, ...], TorchCommunicator] = {}
        #: Payload chunk messages this rank took part in (one per broadcast of data).
        self.chunk_messages = 0
        #: Payload bytes this rank sent or received through ``broadcast_bytes``.
        self.payload_bytes = 0

    # -- identity ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def backend(self) -> str:
        return "torch"

    @property
    def group(self) -> Any:
        """The wrapped ``torch.distributed`` process group."""
        return self._group

    @property
    def device(self) -> torch.device:
        """Where this communicator's tensors live (CUDA on NCCL, else CPU)."""
        return self._device

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def chunk_bytes(self) -> int:
        return self._chunk_bytes

    def __repr__(self) -> str:
        return (
            f"TorchCommunicator(rank={self._rank}, size={self._size}, "
            f"backend={self._backend_name!r}, node_id={self._node_id!r})"
        )

    # -- plumbing ---------------------------------------------------------------------

    def _wait_for(self, timeout: float | None) -> float:
        if self._broken is not None:
            raise CommError(
                f"rank {self._rank}/{self._size}: this torch communicator is unusable after "
                f"{self._broken}; create a new communicator",
                op="reuse",
                rank=self._rank,
                backend="torch",
            )
        return self._timeout if timeout is None else timeout

    def _run(self, op: str, wait: float, start: Any, *args: Any, **kwargs: Any) -> None:
        """Issue one async collective and wait for it, translating torch's errors."""
        try:
            work = start(*args, group=self._group, async_op=True, **kwargs)
            if self._device.type == "cpu":
                work.wait(timeout=timedelta(seconds=wait))
            else:
                self._poll(work, wait)
        except RuntimeError as exc:  # DistBackendError, DistError are RuntimeErrors
            text = str(exc)
            if any(marker in text for marker in _TIMEOUT_MARKERS):
                self._broken = f"{op} timed out after {wait:g} s"
                raise CollectiveTimeout(
                    f"{op} on rank {self._rank}/{self._size} ({self._node_id}) did not "
                    f"complete within {wait:g} s: a peer rank never arrived; check for a "
                    "crashed or stalled rank, or raise DISTCACHE_TIMEOUT",
                    op=op,
                    timeout=wait,
                    rank=self._rank,
                    backend="torch",
                ) from exc
            self._broken = f"{op} failed"
            raise CommError(
                f"{op} failed on rank {self._rank}/{self._size} ({self._node_id}) over "
                f"{self._backend_name}: {text}",
                op=op,
                rank=self._rank,
                backend="torch",
            ) from exc

    @staticmethod
    def _poll(work: Any, wait: float) -> None:
        # On NCCL, Work.wait() only makes the current CUDA stream wait; the host would
        # then block, with no bound, on the first read of the result. Polling the
        # work's completion bounds the host-side wait instead.
        deadline = time.monotonic() + wait
        pause = _POLL_MIN_S
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise RuntimeError(f"collective timed out after {wait:g} s (polled)")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        work.wait()

    def _bytes_tensor(self, data: bytes | bytearray) -> torch.Tensor:
        torch = self._torch
        if len(data) == 0:
            return torch.empty(0, dtype=torch.uint8, device=self._device)
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return tensor.to(self._device) if self._device.type != "cpu" else tensor

    def _to_bytes(self, tensor: torch.Tensor) -> bytes:
        if tensor.numel() == 0:
            return b""
        host = bytearray(tensor.numel())
        self._torch.frombuffer(host, dtype=self._torch.uint8).copy_(tensor)
        return bytes(host)

    def _global(self, rank: int) -> int:
        return int(self._dist.get_global_rank(self._group, rank))

    # -- collectives ------------------------------------------------------------------

    def broadcast_bytes(
        self, data: bytes | None, root: int, *, timeout: float | None = None
    ) -> bytes:
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} is out of range for a communicator of size {self._size}")
        if self._rank == root and data is None:
            raise ValueError("broadcast_bytes: the root rank must pass data")
        wait = self._wait_for(timeout)
        torch, dist = self._torch, self._dist
        is_root = self._rank == root and data is not None
        src = self._global(root)
        header = torch.tensor(
            [len(data) if is_root and data is not None else 0],
            dtype=torch.int64,
            device=self._device,
        )
        self._run("broadcast_bytes", wait, dist.broadcast, header, src)
        total = int(header.item())
        if is_root and data is not None:
            payload = self._bytes_tensor(data)
        else:
            payload = torch.empty(total, dtype=torch.uint8, device=self._device)
        for start, stop in chunk_spans(total, self._chunk_bytes):
            # A slice of a contiguous 1-D tensor is contiguous: broadcast in place.
            self._run("broadcast_bytes", wait, dist.broadcast, payload[start:stop], src)
            self.chunk_messages += 1
        self.payload_bytes += total
        if is_root and isinstance(data, bytes):
            return data
        return self._to_bytes(payload)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        wait = self._wait_for(timeout)
        torch, dist = self._torch, self._dist
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(mine)], dtype=torch.int64, device=self._device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self._device) for _ in range(self._size)]
        self._run("allgather_object", wait, dist.all_gather, sizes, size)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        if longest > MAX_MESSAGE_BYTES:
            raise CommError(
                f"allgather_object: a pickled object of {longest} bytes exceeds one message "
                f"({MAX_MESSAGE_BYTES}); all-gather small objects only",
                op="allgather_object",
                rank=self._rank,
                backend="torch",
            )
        # all_gather needs equal shapes: pad every rank's bytes to the longest.
        padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=self._device)
        if mine:
            padded[: len(mine)] = self._bytes_tensor(mine)
        parts = [torch.empty_like(padded) for _ in range(self._size)]
        self._run("allgather_object", wait, dist.all_gather, parts, padded)
        return [
            pickle.loads(self._to_bytes(part[:n]))
            for part, n in zip(parts, lengths, strict=True)
        ]

    def barrier(self, *, timeout: float | None = None) -> None:
        # dist.barrier() takes no timeout on most backends; an all-reduce of one
        # element waited with a timeout is a barrier that can give up.
        wait = self._wait_for(timeout)
        token = self._torch.zeros(1, dtype=self._torch.int32, device=self._device)
        self._run("barrier", wait, self._dist.all_reduce, token)

    def split(self, color: int) -> Communicator:
        dist = self._dist
        # A process group per call would leak its connections (gloo: several sockets
        # per group) on every prefetch and sync; the child for a partition is kept and
        # handed out again. Whether any rank's kept child broke travels in the same
        # all-gather, so every rank rebuilds together and new_group names stay in step.
        broken = any(c._broken is not None for c in self._children.values())
        gathered = self.allgather_object((int(color), broken))
        if any(b for _, b in gathered):
            self._children.clear()
        colors = [c for c, _ in gathered]
        kept = self._children.get(tuple(colors))
        if kept is not None:
            return kept
        members = [self._global(r) for r, c in enumerate(colors) if c == int(color)]
        timeout = timedelta(seconds=self._timeout)
        try:
            if self._size == dist.get_world_size():
                # new_group names groups by a per-process counter, so every rank of the
                # job must create every group, in the same order, to keep names in step.
                mine = None
                for each in sorted(set(colors)):
                    ranks = [self._global(r) for r, c in enumerate(colors) if c == each]
                    made = dist.new_group(ranks, timeout=timeout)
                    if each == int(color):
                        mine = made
            else:
                # Ranks outside this group will not call new_group; hashed names let
                # only the members synchronise (the groups made here are disjoint).
                mine = dist.new_group(members, timeout=timeout, use_local_synchronization=True)
        except RuntimeError as exc:
            raise CommError(
                f"split failed on rank {self._rank}/{self._size} ({self._node_id}): {exc}",
                op="split",
                rank=self._rank,
                backend="torch",
            ) from exc
        made = TorchCommunicator(
            mine, timeout=self._timeout, chunk_bytes=self._chunk_bytes, node_id=self._node_id
        )
        self._children[tuple(colors)] = made
        return made
