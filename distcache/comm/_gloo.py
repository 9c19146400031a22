"""distcache's own gloo process group: never the engine's, never the default group.

The group is built directly on a rendezvous store (:func:`launch.find_store`) under the
prefix of a run scope (:mod:`distcache.comm._scope`) agreed when it is made, so making
it runs no collective on any group of the engine, and a store shared with other
adoptions (the ``python -m launch`` wrapper's, an earlier ``init``'s, a previous
restart attempt's, another job's) never hands it a stale peer address. torch.distributed's
global state (the default group, the group registry) is never touched:
``torch.distributed.is_initialized()`` stays what the engine made it. Collectives are
issued on the group object itself. A timed-out collective stays queued on this group
only; the communicator then refuses further use and the engine's groups carry on (the
engine's watchdog never sees distcache's work).

Splits build their own groups from the same store under the parent's scope, a prefix
per partition and per time the partition was made, so only the members of a part
rendezvous, and a part made again after :data:`~distcache.comm._backend.MAX_CHILDREN`
evicted it does not meet stale keys.
"""

from __future__ import annotations

import hashlib
import os
import time
from datetime import timedelta
from typing import Any, Self

from distcache._log import get_logger
from distcache.comm._scope import RunScope, job_root, meet, share_secret
from distcache.comm._torch import TorchCommunicator, import_torch
from distcache.config import settings
from distcache.errors import CollectiveTimeout, CommError, DistcacheError
from launch import run_id

log = get_logger(__name__)


class GlooCommunicator(TorchCommunicator):
    """A communicator over a private gloo group built on ``store``.

    Args:
        store: a ``torch.distributed.Store`` every rank of the group reaches.
        rank: this process's rank in the group.
        size: the number of ranks.
        scope: the run scope to meet under; default: agree on a fresh one over
            ``store`` with every rank (:func:`~distcache.comm._scope.meet`), for the
            job and attempt ``run`` names.
        run: ``(job, attempt)`` when agreeing on a scope (default: what the
            launcher's variables say, :func:`launch.run_id`).
        prefix: the key prefix the group meets under (default: the scope's).
        until: the ``time.monotonic()`` by which the ranks must meet, make the group
            and share the scope (default: ``timeout`` from now). It bounds making the
            communicator only: each collective has what is left of its call's.
        timeout, chunk_bytes, node_id: as for every communicator.

    Raises:
        CommError: torch.distributed is missing, or the group could not be made.
        CollectiveTimeout: a peer did not arrive by ``until``.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """

    _kind = "gloo"
    _label = "gloo (distcache's own)"
    #: Whether the group keeps its timeout for its life (else it bounds connecting only).
    _group_keeps_timeout = False

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        *,
        scope: RunScope | None = None,
        run: tuple[str, int] | None = None,
        prefix: str | None = None,
        until: float | None = None,
        timeout: float | None = None,
        chunk_bytes: int | None = None,
        node_id: str | None = None,
    ) -> None:
        torch, dist = import_torch()
        # The timeout bounds the rendezvous too: a peer that never comes makes the
        # constructor raise instead of waiting for torch's default 30 minutes.
        wait = settings(timeout=timeout).timeout
        until = time.monotonic() + wait if until is None else until
        self._store = store
        self._made: dict[tuple[int, ...], int] = {}
        agreeing: tuple[str, int, str] | None = None
        if scope is None:
            job, attempt = run if run is not None else run_id(os.environ)[:2]
            nonce, agreed = meet(store, rank, size, job, attempt, until)
            agreeing = (job, agreed, nonce)
            base = f"{job_root(job)}/{nonce}"
        else:
            base = scope.prefix
        self._prefix = base if prefix is None else prefix
        # Making the group fits in what is left of ``until``: a rank that met and then
        # went away must not hold the others one more whole timeout. On gloo the
        # group's timeout bounds only that (each collective sets its own, _timed);
        # NCCL keeps the communicator's (its watchdog's, for the group's life, which
        # a rank that met late would leave a sliver of).
        left = until - time.monotonic()
        if left <= 0:
            raise CollectiveTimeout(
                f"rank {rank}/{size}: no time left to make distcache's {self._kind} group "
                f"within the {wait:g} s timeout", op="init", rank=rank, timeout=wait)
        try:
            group = self._make_group(
                torch, dist, dist.PrefixStore(self._prefix, store), rank, size,
                timedelta(seconds=wait if self._group_keeps_timeout else left))
        except RuntimeError as exc:
            text = (f"rank {rank}/{size}: cannot make distcache's {self._kind} group under "
                    f"{self._prefix!r}: {exc}; every rank must call distcache.init (or the "
                    "same collective) within the timeout")
            if "timeout" in str(exc).lower() and "connect" not in str(exc).lower():
                raise CollectiveTimeout(text, op="init", rank=rank, timeout=wait) from exc
            raise CommError(text, op="init", rank=rank, backend=self._kind) from exc
        self._setup(torch, dist, group, rank, size, self._kind, timeout=timeout,
                    chunk_bytes=chunk_bytes, node_id=node_id)
        if agreeing is not None:
            # The secret travels over the group just made, never through the store.
            try:
                scope = RunScope(*agreeing, share_secret(self, until))
            except DistcacheError:
                self.close()
                raise
        assert scope is not None  # given, or agreed just above
        self._scope = scope

    @staticmethod
    def _make_group(torch: Any, dist: Any, store: Any, rank: int, size: int,
                    timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    @property
    def prefix(self) -> str:
        """The store key prefix this group met under."""
        return self._prefix

    @property
    def scope(self) -> RunScope:
        """The run scope every rank of this group agreed on (splits share it)."""
        return self._scope

    def _repr_extra(self) -> str:
        return f"prefix={self._prefix!r}, "

    def _release(self, why: str) -> None:
        super()._release(why)
        self._store = None

    def _global(self, rank: int) -> int:
        return rank

    # -- collectives on the group object: torch's registry does not know this group ----
    # Each carries what is left of its call's timeout: gloo honours it, so a call may
    # outlast the group's timeout, and one that gives up leaves no operation waiting
    # out the group's (which would hold up close). NCCL's host wait is polled instead.

    def _timed(self, options: Any) -> Any:
        options.timeout = self._op_timeout
        return options

    def _start_broadcast(self, tensor: Any, root: int) -> Any:
        options = self._timed(self._dist.distributed_c10d.BroadcastOptions())
        options.rootRank = root
        return self._group.broadcast([tensor], options)

    def _start_allgather(self, outs: list[Any], tensor: Any) -> Any:
        options = self._timed(self._dist.distributed_c10d.AllgatherOptions())
        return self._group.allgather([outs], [tensor], options)

    def _start_allreduce(self, tensor: Any) -> Any:
        options = self._timed(self._dist.distributed_c10d.AllreduceOptions())
        return self._group.allreduce([tensor], options)

    def _split_child(self, colors: tuple[int, ...], color: int) -> Self:
        if self._store is None:
            raise CommError("the communicator was released", op="split", backend="gloo")
        members = [r for r, c in enumerate(colors) if c == color]
        times = self._made.get(colors, 0)
        self._made[colors] = times + 1
        partition = hashlib.sha256(repr(colors).encode()).hexdigest()[:16]
        prefix = f"{self._prefix}/split-{partition}-{times}/{color}"
        log.debug("split %s: ranks %s under %r", self._prefix, members, prefix)
        return type(self)(self._store, members.index(self._rank), len(members),
                          scope=self._scope, prefix=prefix, **self._inherited())


class NcclCommunicator(GlooCommunicator):
    """A private NCCL group for bulk bytes, built like :class:`GlooCommunicator` on a
    store, on this process's current CUDA device. Only ``init(transport="nccl")``
    makes one, for the prefetch, and closes it after.

    Raises:
        CommError: CUDA or NCCL is unavailable, or the group could not be made.
    """

    _kind = "nccl"
    _label = "NCCL (distcache's own)"
    _group_keeps_timeout = True

    @staticmethod
    def _make_group(torch: Any, dist: Any, store: Any, rank: int, size: int,
                    timeout: timedelta) -> Any:
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise RuntimeError("CUDA with NCCL is not available in this process")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
