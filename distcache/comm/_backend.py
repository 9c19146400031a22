"""What the process-group backends share: every policy of a real communicator.

:class:`BackendCommunicator` implements the :class:`~distcache.comm._base.Communicator`
protocol once: option resolution and checks, identity, the broken-after-timeout
state and its refusal, the chunked broadcast (length first, then chunks of at most
``chunk_bytes``; small payloads ride with their lengths, :mod:`~distcache.comm._inline`),
the plain-data wire form of ``allgather_object`` (:mod:`distcache.comm._codec`: no
pickle, a malformed peer payload is a :class:`~distcache.errors.WireError`), the
``chunk_messages`` and ``payload_bytes`` counters, and ``split``'s agreement and child cache.

A backend supplies only its transport. Each primitive starts one collective,
waits for it no longer than the :class:`Budget` allows, and translates the
transport's errors (:meth:`BackendCommunicator._timed_out`,
:meth:`BackendCommunicator._comm_error`):

* ``_broadcast_block(block, width, root, budget)``: the root's ``block`` (``width``
  bytes; ``None`` on the other ranks);
* ``_payload_buffer(data, total)``: a buffer holding the root's ``data``, or
  ``total`` bytes to receive into;
* ``_broadcast_span(buffer, start, stop, root, budget)``: one chunk, in place;
* ``_buffer_bytes(buffer) -> bytes``: the received payload (and, optionally,
  ``_lent_buffer``/``_owned_buffer``: the same without copies, for
  :meth:`BackendCommunicator.broadcast_buffer`);
* ``_allgather_blocks(block, budget)``: every rank's ``block`` (all of one width),
  in rank order;
* ``_allgather_payloads(mine, lengths, budget)``: every rank's bytes, in rank
  order (refusing, with :meth:`BackendCommunicator._too_large`, what exceeds one
  message of the transport);
* ``_barrier(budget)``;
* ``_split_child(colors, color)``: a communicator of the same class over the ranks
  whose color is ``color`` (``colors`` has every rank's, in rank order), built with
  ``**self._inherited()``.

A subclass sets ``_rank`` and ``_size`` in its constructor, after calling
``super().__init__`` with the caller's options, and names itself with ``_kind``
(:attr:`backend`) and ``_label`` (the word used in messages).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, ClassVar, NamedTuple, Self

from distcache.comm import _inline
from distcache.comm._base import (
    MAX_MESSAGE_BYTES,
    check_broadcast,
    check_timeout,
    chunk_spans,
    hostname,
)
from distcache.comm._codec import decode_each, encode
from distcache.comm._inline import HEAD, INLINE_MAX, carried, head, inline_width, length_of
from distcache.config import settings
from distcache.errors import CollectiveTimeout, CommError, WireError

#: Most children one communicator keeps from ``split``; the least recently used one
#: beyond this is closed. The collective splits off at most a handful of audiences per
#: call, and the same ones again on every prefetch and sync of a job.
MAX_CHILDREN = 8


class Budget(NamedTuple):
    """The time one collective call may take."""

    #: The timeout the caller asked for (or the communicator's default), in seconds.
    seconds: float
    #: ``time.monotonic()`` value at which the whole call gives up.
    until: float


class BackendCommunicator(ABC):
    """A :class:`~distcache.comm._base.Communicator` whose transport a subclass supplies.

    Raises:
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
        ValueError: ``timeout`` or ``chunk_bytes`` is out of range.
    """

    #: :attr:`backend`, e.g. ``"mpi"``.
    _kind: ClassVar[str]
    #: The transport's name in messages, e.g. ``"MPI"``.
    _label: ClassVar[str]

    _rank: int
    _size: int

    def __init__(self, *, timeout: float | None = None, chunk_bytes: int | None = None,
                 node_id: str | None = None) -> None:
        conf = settings(timeout=timeout, chunk_bytes=chunk_bytes, node_id=node_id)
        if not 0 < conf.chunk_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(
                f"chunk_bytes must be between 1 and {MAX_MESSAGE_BYTES} (2 GiB - 1), "
                f"got {conf.chunk_bytes}"
            )
        self._timeout = conf.timeout
        self._chunk_bytes = conf.chunk_bytes
        self._node_id = conf.node_id if conf.node_id is not None else hostname()
        #: The most a broadcast_bytes receiver accepts unless the call says
        #: (``max_bytes``): a bucket's worth beside the largest artifact of unknown size
        #: (broadcast_buffer's bulk data: what this host's memory could hold).
        self.max_broadcast_bytes = conf.max_artifact_bytes + conf.bucket_bytes
        self._broken: str | None = None
        # split() results by the all-gathered colors, least recently used first (see
        # split); at most MAX_CHILDREN are kept.
        self._children: OrderedDict[tuple[int, ...], Self] = OrderedDict()
        # split_owned() results: closed with this communicator, never handed out again.
        self._owned_children: list[Self] = []
        #: Communicators this one created by ``split`` over its life (kept or let go).
        self.groups_made = 0
        self._closed = False
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
        return self._kind

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def usable(self) -> bool:
        """False once the communicator timed out, failed or was closed."""
        return self._broken is None

    @property
    def chunk_bytes(self) -> int:
        return self._chunk_bytes

    def _repr_extra(self) -> str:
        """Backend details for ``repr``, each followed by ``", "``."""
        return ""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self._rank}, size={self._size}, "
            f"{self._repr_extra()}node_id={self._node_id!r})"
        )

    def _inherited(self) -> dict[str, Any]:
        """Constructor options a child communicator takes over from this one."""
        return {"timeout": self._timeout, "chunk_bytes": self._chunk_bytes,
                "node_id": self._node_id}

    # -- state and errors -------------------------------------------------------------

    def _budget(self, timeout: float | None) -> Budget:
        """The time a call starting now may take; refuses a broken communicator."""
        if self._broken is not None:
            raise CommError(
                f"rank {self._rank}/{self._size}: this {self._label} communicator is unusable "
                f"after {self._broken}; create a new communicator",
                op="reuse", rank=self._rank, backend=self._kind)
        wait = self._timeout if timeout is None else timeout
        check_timeout(wait)
        return Budget(wait, time.monotonic() + wait)

    def _timed_out(self, op: str, wait: float) -> CollectiveTimeout:
        """Retire this communicator (a started collective cannot be cancelled)."""
        self._broken = f"{op} timed out after {wait:g} s"
        return CollectiveTimeout(
            f"{op} on rank {self._rank}/{self._size} ({self._node_id}) did not "
            f"complete within {wait:g} s: a peer rank never arrived; check for "
            "a crashed or stalled rank, or raise DISTCACHE_TIMEOUT",
            op=op, timeout=wait, rank=self._rank, backend=self._kind)

    def _comm_error(self, op: str, exc: BaseException, *, over: str = "") -> CommError:
        """The transport failed ``op`` (``over``: the transport's own backend, if any)."""
        via = f" over {over}" if over else ""
        return CommError(
            f"{op} failed on rank {self._rank}/{self._size} ({self._node_id}){via}: {exc}",
            op=op, rank=self._rank, backend=self._kind)

    def _too_large(self, text: str) -> CommError:
        return CommError(f"allgather_object: {text}; all-gather small objects only",
                         op="allgather_object", rank=self._rank, backend=self._kind)

    # -- collectives ------------------------------------------------------------------

    def broadcast_bytes(self, data: bytes | None, root: int, *, timeout: float | None = None,
                        max_bytes: int | None = None) -> bytes:
        """The protocol's ``broadcast_bytes``; a payload the root announces past
        ``max_bytes`` (every rank passes the same; None: :attr:`max_broadcast_bytes`)
        is a :class:`~distcache.errors.WireError` on every rank, before any allocates
        for it, and leaves the communicator unusable."""
        received = self._broadcast(data, root, timeout, lend=False, most=max_bytes)
        return received if isinstance(received, bytes) else bytes(received)

    def broadcast_buffer(self, data: bytearray | None, root: int, *,
                         timeout: float | None = None, max_bytes: int | None = None
                         ) -> bytes | bytearray:
        """:meth:`broadcast_bytes` for bulk data, without its copies where the transport
        allows: the root lends ``data`` (it must not change it afterwards, even when
        this raises) and every other rank gets a buffer of its own."""
        return self._broadcast(data, root, timeout, lend=True, most=max_bytes)

    def _broadcast(self, data: bytes | bytearray | None, root: int, timeout: float | None,
                   *, lend: bool, most: int | None) -> bytes | bytearray:
        check_broadcast(self._rank, self._size, root, data)
        _inline.check_most(most)
        budget = self._budget(timeout)
        mine = data if self._rank == root else None
        # Bulk data (lend) is chunked from the start; a small payload is one message.
        # The head's width is fixed, never a per-process setting: every rank must post
        # the same size.
        width = 0 if lend else INLINE_MAX
        block = self._broadcast_block(None if mine is None else head(mine, width),
                                      HEAD + width, root, budget)
        total = length_of(block)
        cap, why = _inline.accepted(most, lend, self.max_broadcast_bytes)
        refused = _inline.refusal(total, cap, root, self._rank, self._size, self._node_id,
                                  backend=self._kind, why=why)
        if refused is not None:  # the root may send chunks no rank takes: out of step
            self._broken = self._broken or f"broadcast_bytes refused {total} bytes"
            raise refused
        if total <= width:
            self.chunk_messages += total > 0
            self.payload_bytes += total
            if mine is not None:
                return mine
            got = carried(block, total, width)
            return bytearray(got) if lend else bytes(got)
        if lend:
            buffer = self._lent_buffer(mine, total)
        else:
            buffer = self._payload_buffer(None if mine is None else bytes(mine), total)
        for start, stop in chunk_spans(total, self._chunk_bytes):
            self._broadcast_span(buffer, start, stop, root, budget)
            self.chunk_messages += 1
        self.payload_bytes += total
        if mine is not None:
            return mine
        return self._owned_buffer(buffer) if lend else self._buffer_bytes(buffer)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        # A value that cannot be sent is refused before this rank enters the collective.
        mine = encode(obj)
        parts = self._allgather_encoded(mine, self._budget(timeout))
        # This rank's own part is decoded too, so that every rank sees the same values;
        # many ranks send alike (a node id, a split's color, "no failure").
        where = f"rank {self._rank}/{self._size} ({self._node_id})"
        return decode_each(((bytes(part), part) for part in parts), where,
                           rank=self._rank, backend=self._kind)

    def _allgather_encoded(self, mine: bytes, budget: Budget) -> list[Any]:
        """Every rank's encoded payload, in rank order: one round when each fits its
        head, else a second for what lies past the heads."""
        width = inline_width(self._size)
        blocks = self._allgather_blocks(head(mine, width), budget)
        lengths = [length_of(block) for block in blocks]
        if max(lengths) <= width:
            return [carried(b, n, width) for b, n in zip(blocks, lengths, strict=True)]
        if sum(lengths) > MAX_MESSAGE_BYTES:  # every rank read the same lengths
            raise self._too_large(f"{sum(lengths)} encoded bytes over all ranks exceed one "
                                  f"{self._label} message ({MAX_MESSAGE_BYTES})")
        rests = self._allgather_payloads(mine[width:], [max(0, n - width) for n in lengths],
                                         budget)
        return [bytes(carried(b, n, width)) + bytes(rest)
                for b, n, rest in zip(blocks, lengths, rests, strict=True)]

    def barrier(self, *, timeout: float | None = None) -> None:
        self._barrier(self._budget(timeout))

    def split(self, color: int) -> Self:
        # Creating a communicator blocks with no timeout in every backend; an
        # all-gather first proves every rank has arrived (or raises
        # CollectiveTimeout), and lets any int be a color (MPI wants non-negative ones).
        #
        # The child for a partition is kept and handed out again: the collective splits
        # off the same writers on every prefetch and sync, and a communicator per call
        # would pile up for the life of the job (MPICH allows about 2,000; gloo holds
        # several sockets per group). Whether any rank's kept child broke travels in
        # the same all-gather, so every rank drops its children together and no rank
        # creates a communicator alone (torch's group names must stay in step, too).
        broken = any(c._broken is not None for c in self._children.values())
        gathered = self.allgather_object((int(color), broken))
        colors = self._colors([e[0] if type(e) is tuple and len(e) == 2 else None
                               for e in gathered], "split")
        if any(b for _, b in gathered):
            self._let_go_children("a kept child broke")
        kept = self._children.get(colors)
        if kept is not None:
            self._children.move_to_end(colors)
            return kept
        made = self._split_child(colors, int(color))
        self.groups_made += 1
        self._children[colors] = made
        # Bounded: a job whose partitions keep changing must not pile up groups. Every
        # rank made the same calls in the same order, so every rank lets go of the same
        # child here, together.
        while len(self._children) > MAX_CHILDREN:
            _, oldest = self._children.popitem(last=False)
            oldest.close()
        return made

    def split_owned(self, color: int) -> Self:
        """:meth:`split`, but the child is the caller's alone: never handed out by a
        later ``split`` of the same partition, never let go to bound the kept ones
        (a communicator that one thread uses while another splits off the same ranks
        to use at the same time must not be one object). :meth:`close` of this
        communicator closes it too. Collective."""
        gathered = self.allgather_object(int(color))
        return self._keep_owned(self._split_child(self._colors(gathered, "split_owned"),
                                                  int(color)))

    def _colors(self, gathered: list[Any], op: str) -> tuple[int, ...]:
        """Every rank's split color; one that is not an int is a WireError, raised alike
        on every rank (every rank read the same all-gather)."""
        for peer, color in enumerate(gathered):
            if type(color) is not int:
                raise WireError(f"{op} on rank {self._rank}/{self._size}: rank {peer} sent no "
                                "split color; check that every rank runs the same distcache",
                                op=op, rank=self._rank, backend=self._kind, peer=peer)
        return tuple(gathered)

    def _keep_owned(self, made: Self) -> Self:
        """Count ``made`` and keep it among the children :meth:`close` closes."""
        self.groups_made += 1
        self._owned_children.append(made)
        return made

    def _let_go_children(self, why: str) -> None:
        for child in self._children.values():
            child._release(why)
        self._children.clear()

    def close(self) -> None:
        """Let go of this communicator and every child it split off; later calls
        raise :class:`~distcache.errors.CommError`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._let_go_children("it was closed")
        for child in self._owned_children:
            child.close()
        self._owned_children.clear()
        self._release("it was closed")

    def _release(self, why: str) -> None:
        """Free the transport's resources and refuse later calls (``why`` says why)."""
        self._broken = self._broken or why

    # -- transport primitives ---------------------------------------------------------

    @abstractmethod
    def _broadcast_block(self, block: bytes | None, width: int, root: int,
                         budget: Budget) -> bytes | bytearray: ...

    @abstractmethod
    def _payload_buffer(self, data: bytes | None, total: int) -> Any: ...

    @abstractmethod
    def _broadcast_span(
        self, buffer: Any, start: int, stop: int, root: int, budget: Budget
    ) -> None: ...

    @abstractmethod
    def _buffer_bytes(self, buffer: Any) -> bytes: ...

    def _lent_buffer(self, data: bytes | bytearray | None, total: int) -> Any:
        """What :meth:`broadcast_buffer` sends from or receives into; a transport that
        can use the root's ``bytearray`` in place says so here."""
        return self._payload_buffer(None if data is None else bytes(data), total)

    def _owned_buffer(self, buffer: Any) -> bytes | bytearray:
        """The received payload of :meth:`broadcast_buffer`, uncopied where possible."""
        return self._buffer_bytes(buffer)

    @abstractmethod
    def _allgather_blocks(self, block: bytes, budget: Budget) -> list[Any]: ...

    @abstractmethod
    def _allgather_payloads(self, mine: bytes, lengths: list[int], budget: Budget) -> list[Any]: ...

    @abstractmethod
    def _barrier(self, budget: Budget) -> None: ...

    @abstractmethod
    def _split_child(self, colors: tuple[int, ...], color: int) -> Self: ...
