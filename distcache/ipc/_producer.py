"""The producer side of an IPC pool: :class:`ProducerPool`, the base of the shared
memory and CUDA pools.

It turns the allocator's leases (:mod:`distcache.ipc._allocator`) into the producer's
API: ``put`` copies a tensor into a lease and returns a :class:`FeatureRef`,
``cancel``/``reclaim`` give leases back, ``descriptor`` tells consumers how to map the
pool. What differs between backends (where the memory lives, how a tensor is
written, how the memory is freed) is left to a few hooks; everything else lives here
once, apart from the allocator, which knows nothing of tensors or refs.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

from distcache._log import DEBUG, WARNING, get_logger
from distcache.errors import IpcError
from distcache.ipc._allocator import Lease, SlotAllocator
from distcache.ipc._consumers import ConsumerTable
from distcache.ipc._descriptor import PoolDescriptor
from distcache.ipc._layout import ControlWords, Layout, align_up
from distcache.ipc._ref import FeatureRef
from distcache.ipc._wire import check_pool_id, consumer_ranks, itemsize

log = get_logger(__name__)

#: Ack words per slot when the consumers are only known at exchange time (one
#: slot row is then 66 words: ready, lease, two audience words, 62 + 1 acks).
DEFAULT_ACK_WORDS = 63
DEFAULT_SLOTS = 1024


class ProducerPool:
    """What both backends share: leases, ``put``, ``cancel``, the descriptor.

    A backend provides the memory (``_write``, ``_publish``, ``_handle``,
    ``_check_tensor``) and its lifetime (``_free``, ``unlink``); the control words go
    to :meth:`_start`.
    """

    backend = ""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        consumers: Sequence[int] | None,
        name: str | None,
        slots: int,
        device: int,
    ) -> None:
        if type(capacity_bytes) is not int or capacity_bytes <= 0:
            raise IpcError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if type(slots) is not int or not 1 <= slots <= 1 << 20:
            raise IpcError(f"slots must be an integer in [1, 2**20], got {slots!r}")
        self.pool_id = (
            name if name is not None else f"{self.backend}-{os.getpid()}-{secrets.token_hex(4)}"
        )
        check_pool_id(self.pool_id)
        # A restarted producer gets a later epoch, so consumers can tell its refs
        # from the previous incarnation's even though the pool id is the same.
        self.epoch = time.time_ns()
        self.capacity = align_up(capacity_bytes)
        self.slots = slots
        self.device = device
        self._explicit = None if consumers is None else consumer_ranks(consumers, self.pool_id)
        self.ack_words = len(self._explicit) if self._explicit is not None else DEFAULT_ACK_WORDS
        self.layout = Layout(slots, self.ack_words)
        self.data_start = self.layout.header_bytes
        self.owner: int | None = None
        self.node_id = ""
        self.consumers: tuple[int, ...] | None = None
        #: Number of ``put`` calls answered "no lease" because the pool was full.
        self.full_count = 0
        self._lock = threading.Lock()
        self._closed = False
        self._bound = False
        self._alloc: SlotAllocator | None = None
        self._table: ConsumerTable | None = None
        # Consumer rank -> its index (ack word); set at bind.
        self._index: dict[int, int] = {}

    def _start(self, words: ControlWords) -> None:
        self._table = ConsumerTable(words, self.layout)
        self._alloc = SlotAllocator(
            self.capacity,
            data_start=self.data_start,
            slots=self.slots,
            ack_words=self.ack_words,
            words=words,
            gone=self._table.gone,
        )
        if self._explicit is not None:
            self._alloc.bind(len(self._explicit))

    # -- backend hooks --------------------------------------------------------------
    def _handle(self) -> bytes:
        raise NotImplementedError

    def _write(self, offset: int, tensor: Any) -> None:
        raise NotImplementedError

    def _check_tensor(self, tensor: Any) -> None:
        raise NotImplementedError

    def _free(self) -> None:
        raise NotImplementedError

    def _publish(self, lease: Lease) -> None:
        """Mark the lease ready once its bytes are written (the host backend writes
        the word now; the CUDA backend orders the write after the copy on its stream)."""
        self._allocator().publish(lease)

    #: Whether the pool's memory still has a system-wide name (backends set it).
    _linked = False

    @property
    def linked(self) -> bool:
        """Whether consumers can still map the pool by name (until :meth:`unlink`)."""
        return self._linked

    def unlink(self) -> None:
        """Remove the pool's system-wide name, if it has one; existing mappings stay."""

    @property
    def explicit_consumers(self) -> tuple[int, ...] | None:
        """The consumer ranks given when the pool was made (None: the node's others)."""
        return self._explicit

    # -- protocol -------------------------------------------------------------------
    def bind(self, owner: int | None, consumers: Sequence[int], node_id: str = "") -> None:
        """Fix the owner rank and the consumer ranks (the registry does this at exchange).

        ``owner`` is None for a producer that is not a rank of the consumers'
        communicator: it binds its pool to the consumer ranks itself and sends
        :meth:`descriptor` (``.pack()``) over any channel; each consumer maps it with
        :meth:`PoolRegistry.add`. ``consumers`` is ignored when the pool was created
        with explicit consumers.

        Raises:
            IpcError: a consumer is not a rank, the owner is among the consumers, or
                there are more consumers than ack words per slot.
        """
        ranks = self._explicit
        if ranks is None:
            ranks = consumer_ranks(consumers, self.pool_id)
        if self._bound and (owner, ranks) != (self.owner, self.consumers):
            raise IpcError(
                f"pool {self.pool_id} is already bound to owner {self.owner} and consumers "
                f"{list(self.consumers or ())}; consumers map it by those indices",
                pool_id=self.pool_id,
            )
        if len(set(ranks)) != len(ranks):
            raise IpcError(
                f"pool {self.pool_id}: consumer ranks {list(ranks)} repeat a rank",
                pool_id=self.pool_id,
            )
        if owner is not None and owner in ranks:
            raise IpcError(
                f"pool {self.pool_id}: owner rank {owner} cannot consume its own pool",
                pool_id=self.pool_id,
            )
        if len(ranks) > self.ack_words:
            raise IpcError(
                f"pool {self.pool_id} has {len(ranks)} consumers but only {self.ack_words} ack "
                "words per slot; pass consumers=[ranks...] when creating it",
                pool_id=self.pool_id,
            )
        with self._lock:
            self._allocator().bind(len(ranks))
            self.owner, self.consumers, self.node_id = owner, ranks, node_id
            self._index = {rank: i for i, rank in enumerate(ranks)}
            self._bound = True

    def descriptor(self) -> PoolDescriptor:
        """How a consumer maps this pool.

        Raises:
            IpcError: the pool is closed or not bound to an owner and consumers yet.
        """
        self._check_open()
        if not self._bound or self.consumers is None:
            raise IpcError(
                f"pool {self.pool_id} is not bound to an owner yet; exchange it first",
                pool_id=self.pool_id,
            )
        return PoolDescriptor(
            pool_id=self.pool_id,
            backend=self.backend,
            owner=self.owner,
            node_id=self.node_id,
            epoch=self.epoch,
            capacity=self.capacity,
            data_start=self.data_start,
            slots=self.slots,
            ack_words=self.ack_words,
            device=self.device,
            consumers=self.consumers,
            handle=self._handle(),
        )

    def put(
        self,
        tensor: Any,
        consumers: Sequence[int] | None = None,
        *,
        with_descriptor: bool = False,
    ) -> FeatureRef | None:
        """Copy a contiguous tensor into a lease; None when the pool is full for now.

        ``consumers`` are the ranks that will read the feature, and the only ones that
        must acknowledge it: None means every consumer of the pool; under attention-DP
        pass the one scheduler that takes it. A consumer that leaves or dies releases
        its part of every lease. A full pool answers at once (the caller retries after
        :meth:`reclaim`, or sends a copy) and is logged once per pool, not per call.
        A tensor larger than the pool's capacity could never fit, so it raises instead.
        ``with_descriptor`` makes the ref carry the pool's descriptor, so a consumer
        that has not mapped this epoch can map it.

        Raises:
            IpcError: the pool is closed or not exchanged yet; the tensor is not
                contiguous, on the wrong device, or of an unsupported dtype; its
                bytes exceed the pool's capacity; or ``consumers`` is empty or names
                a rank that is not a consumer.
        """
        self._check_open()
        self._check_tensor(tensor)
        if not tensor.is_contiguous():
            raise IpcError(
                "put() needs a contiguous tensor; call .contiguous() first", pool_id=self.pool_id
            )
        # A lazy conjugate or negative view stores its values, not the raw memory.
        tensor = tensor.resolve_conj().resolve_neg()
        audience = self._audience(consumers)
        dtype = str(tensor.dtype).removeprefix("torch.")
        nbytes = int(tensor.numel()) * itemsize(dtype)
        carried = self.descriptor() if with_descriptor else None
        with self._lock:
            self._check_open()
            alloc = self._allocator()
            lease = alloc.allocate(nbytes, audience, pool_id=self.pool_id)  # may refuse
            if lease is None:
                self.full_count += 1
                level = WARNING if self.full_count == 1 else DEBUG
                log.log(
                    level,
                    "IPC pool %s is full (%d bytes, %d leases in flight): features "
                    "wait or are sent by copy until consumers acknowledge; consider a "
                    "larger pool",
                    self.pool_id,
                    self.capacity,
                    alloc.in_flight,
                )
                return None
            try:
                # The ref first: a tensor it cannot describe (more than MAX_NDIM
                # dimensions) is refused before a byte is written, and its lease goes.
                ref = FeatureRef(
                    pool_id=self.pool_id, epoch=self.epoch, offset=lease.offset,
                    nbytes=nbytes, dtype=dtype, shape=tuple(int(d) for d in tensor.shape),
                    strides=tuple(int(s) for s in tensor.stride()), slot=lease.slot,
                    generation=lease.generation, descriptor=carried,
                )  # fmt: skip
                self._write(lease.offset, tensor)
                self._publish(lease)
            except BaseException:
                alloc.cancel(lease.slot, lease.generation)
                raise
            self._unlink_when_mapped()
        return ref

    def _audience(self, consumers: Sequence[int] | None) -> tuple[int, ...] | None:
        if consumers is None:
            return None
        if not self._bound:
            raise IpcError(
                f"pool {self.pool_id} is not bound to its consumers yet; exchange it first",
                pool_id=self.pool_id,
            )
        try:  # ranks as the pool's consumers are: no bool, float or string
            ranks = consumer_ranks(consumers, self.pool_id)
            audience = tuple(sorted({self._index[rank] for rank in ranks}))
        except (IpcError, KeyError):
            raise IpcError(
                f"pool {self.pool_id}: readers {consumers!r} are not all consumers of "
                f"the pool (consumers: {list(self.consumers or ())})",
                pool_id=self.pool_id,
            ) from None
        if not audience:
            raise IpcError(
                f"pool {self.pool_id}: put() needs at least one reader, or consumers=None "
                "for all of them",
                pool_id=self.pool_id,
            )
        return audience

    def _unlink_when_mapped(self) -> None:
        # A producer outside the consumers' group has no exchange barrier after which
        # to unlink: it unlinks once every consumer's row says it mapped the pool, seen
        # whenever it looks at its consumers (put, reclaim, holders). Once unlinked, or
        # for an owner rank, the first test ends it.
        table, ranks = self._table, self.consumers
        if (
            self._linked
            and self.owner is None
            and table is not None
            and ranks is not None
            and table.all_joined(len(ranks))
        ):
            self.unlink()

    def holders(self) -> list[int]:
        """Consumer ranks that still map this pool (not left, not dead)."""
        if self._table is None or self.consumers is None:
            return []
        # Lock-free, as before: close() calls it (through the CUDA backend's _free)
        # under the lock, and unlink() is idempotent and quiet.
        self._unlink_when_mapped()
        return [self.consumers[i] for i in self._table.holding(len(self.consumers))]

    def cancel(self, ref: FeatureRef) -> None:
        """Free a lease whose ref was never sent.

        Raises:
            IpcError: the ref is not an outstanding lease of this pool.
        """
        if (ref.pool_id, ref.epoch) != (self.pool_id, self.epoch):
            raise IpcError(
                f"ref of pool {ref.pool_id} epoch {ref.epoch} cancelled on pool "
                f"{self.pool_id} epoch {self.epoch}",
                pool_id=self.pool_id,
            )
        with self._lock:
            self._check_open()
            self._allocator().cancel(ref.slot, ref.generation)

    def reclaim(self) -> int:
        """Free every lease whose readers all acknowledged it, left or died (``put``
        also does this lazily, when it would otherwise find the pool full). Never
        blocks: it reads the consumers' words and asks the kernel whether they live.
        A producer outside the group also unlinks the pool's name here once every
        consumer has mapped it, as ``put`` does."""
        with self._lock:
            self._check_open()
            freed = self._allocator().reclaim()
            self._unlink_when_mapped()
            return freed

    @property
    def in_flight(self) -> int:
        """Leases not yet acknowledged by every consumer (as of the last reclaim)."""
        return self._allocator().in_flight

    @property
    def free_bytes(self) -> int:
        return self._allocator().free_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the pool's memory (idempotent). Consumers must have closed first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _allocator(self) -> SlotAllocator:
        if self._alloc is None:
            raise IpcError(f"pool {self.pool_id} has no memory", pool_id=self.pool_id)
        return self._alloc

    def _check_open(self) -> None:
        if self._closed:
            raise IpcError(f"pool {self.pool_id} is closed", pool_id=self.pool_id)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(pool_id={self.pool_id!r}, epoch={self.epoch}, "
            f"capacity={self.capacity})"
        )
