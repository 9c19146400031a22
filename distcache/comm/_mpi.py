"""The mpi4py backend.

Every collective is started non-blocking (``Ibcast``, ``Iallgatherv``, ``Ibarrier``)
and polled with ``Test()`` until a deadline, so a rank that never arrives makes its
peers raise :class:`~distcache.errors.CollectiveTimeout` instead of hanging in a
blocking MPI call. MPI cannot cancel a started collective, so a communicator whose
collective timed out refuses further calls (a later call would be matched against
the abandoned one); build a new communicator to continue.

The policy (chunking, the wire form of objects, split's child cache) is
:class:`~distcache.comm._backend.BackendCommunicator`'s; this module moves bytes.
mpi4py is imported in the constructor, never at module import: importing
``mpi4py.MPI`` calls ``MPI_Init``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Self

from distcache._log import get_logger
from distcache.comm._announce import Announcements, watched
from distcache.comm._arrival import _arrive, node_key
from distcache.comm._backend import BackendCommunicator, Budget
from distcache.comm._base import MAX_MESSAGE_BYTES, poll_until
from distcache.errors import CommError, DistcacheError

log = get_logger(__name__)

#: Communicators larger than this all-gather point to point (:meth:`MpiCommunicator.
#: _bruck`) rather than through the MPI library's non-blocking all-gather; the tags of
#: those rounds start at BRUCK_TAG (64 rounds per phase: any size MPI allows).
BRUCK_ABOVE = 16
BRUCK_TAG = 0x4500
#: The tag of ``MPI_Comm_create_group`` (:meth:`MpiCommunicator.group_owned`): a rank
#: makes one group at a time, so one tag serves them all.
GROUP_TAG = 0x4444


class MpiCommunicator(BackendCommunicator):
    """A :class:`~distcache.comm._base.Communicator` over an mpi4py communicator.

    Args:
        mpi_comm: an ``mpi4py.MPI.Comm`` (default ``COMM_WORLD``); distcache works on
            a duplicate of it, freed by :meth:`close`.
        dup: ``False`` wraps ``mpi_comm`` itself (a communicator already private to
            distcache, such as a child of ``split``).
        timeout: default seconds per collective (default ``DISTCACHE_TIMEOUT``).
        chunk_bytes: largest single broadcast message (default ``DISTCACHE_CHUNK_BYTES``).
        node_id: this rank's node identity (default ``DISTCACHE_NODE_ID``, else the
            hostname).
        announce: bytes of the same length on every rank; rank 0's reach every rank
            with the arrival check before ``Dup`` (no collective of their own), as
            :attr:`announced`.

    Raises:
        CommError: mpi4py cannot be imported or initialised.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
        ValueError: ``timeout`` or ``chunk_bytes`` is out of range.
    """

    _kind = "mpi"
    _label = "MPI"

    def __init__(
        self,
        mpi_comm: Any = None,
        *,
        dup: bool = True,
        timeout: float | None = None,
        chunk_bytes: int | None = None,
        node_id: str | None = None,
        announce: bytes = b"",
    ) -> None:
        try:
            from mpi4py import MPI
        except Exception as exc:  # ImportError, or a broken MPI library at init
            raise CommError(
                f"mpi4py is not usable: {exc}; install mpi4py and an MPI library "
                "(pip install 'distcache[mpi]')",
                op="init",
                backend="mpi",
            ) from exc
        self._MPI = MPI
        super().__init__(timeout=timeout, chunk_bytes=chunk_bytes, node_id=node_id)
        base = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        try:
            # A duplicate is a separate matching context: an abandoned collective of
            # distcache's can never be matched by the caller's next collective on the
            # world (or on the communicator the caller passed). Dup is collective, like
            # every constructor of a communicator here.
            #: Rank 0's ``announce``, the same on every rank.
            self.announced = bytes(announce)
            # Every rank's node key in rank order, where the arrival check carried them.
            self._node_keys: list[bytes] | None = None
            if dup and base.Get_size() > 1:
                self.announced, self._node_keys = _arrive(
                    MPI, base, self._timeout, self.announced, node_key(self.node_id))
            self._comm = base.Dup() if dup else base
            self._rank = int(self._comm.Get_rank())
            self._size = int(self._comm.Get_size())
        except MPI.Exception as exc:
            raise CommError(
                f"cannot duplicate or query the MPI communicator: {exc}", op="init",
                backend="mpi",
            ) from exc
        self._owned = dup
        # Requests abandoned by a timed-out collective; kept alive so that MPI never
        # writes into a buffer Python has already freed.
        self._abandoned: list[tuple[Any, Any]] = []
        # A failing rank's word (distcache.comm._announce), on the duplicate distcache
        # owns; the communicators made from it share it.
        self._words = (Announcements(MPI, self._comm, self._rank, self._size, self.node_id)
                       if dup and self._size > 1 else None)

    @property
    def mpi_comm(self) -> Any:
        """The wrapped ``mpi4py.MPI.Comm``."""
        return self._comm

    # -- one collective: start, then wait within the budget ---------------------------

    def _start(self, op: str, start: Any, *args: Any) -> Any:
        try:
            return start(*args)
        except self._MPI.Exception as exc:
            raise self._comm_error(op, exc) from exc

    def _wait(self, request: Any, op: str, budget: Budget, keep: Any) -> None:
        """Poll ``request`` until it completes or the budget runs out, or another
        rank's failure is heard of."""
        if not self._polled(request.Test, op, budget, [(request, keep)]):
            self._abandoned.append((request, keep))
            raise self._timed_out(op, budget.seconds)

    def _polled(self, test: Any, op: str, budget: Budget, pending: list[Any]) -> bool:
        """Whether ``test`` came true within ``budget``; ``pending`` (requests and
        their buffers) is kept alive where another rank's failure stops the wait."""
        words = self._words
        try:
            return poll_until(test if words is None else watched(test, words.looker()),
                              budget.until)
        except self._MPI.Exception as exc:
            raise self._comm_error(op, exc) from exc
        except DistcacheError as exc:  # heard of: the collective stays pending for ever
            self._abandoned.extend(pending)
            self._broken = f"{op} was left when {exc}"
            raise

    def _budget(self, timeout: float | None) -> Budget:
        # A failure heard of or told retires every communicator sharing the words.
        spent = None if self._words is None else self._words.spent
        if spent is not None and self._broken is None:
            self._broken = spent
        return super()._budget(timeout)

    def announce(self, error: BaseException) -> bool:
        """Tell the other ranks that this one failed with ``error``, so that their
        waits raise it instead of waiting on (:mod:`distcache.comm._announce`); True
        when told. Never raises; False where distcache does not own the communicator."""
        return self._words is not None and self._words.announce(error)

    def _run(self, op: str, budget: Budget, keep: Any, start: Any, *args: Any) -> None:
        self._wait(self._start(op, start, *args), op, budget, keep)

    # -- transport primitives ---------------------------------------------------------

    def _broadcast_block(self, block: bytes | None, width: int, root: int,
                         budget: Budget) -> bytearray:
        buffer = bytearray(width) if block is None else bytearray(block)
        self._run("broadcast_bytes", budget, buffer, self._comm.Ibcast,
                  [buffer, self._MPI.BYTE], root)
        return buffer

    def _payload_buffer(self, data: bytes | None, total: int) -> bytearray:
        # The root broadcasts from a private copy: MPI may need a writable buffer, and
        # the caller's object must not change under an abandoned request.
        return bytearray(total) if data is None else bytearray(data)

    def _broadcast_span(
        self, buffer: bytearray, start: int, stop: int, root: int, budget: Budget
    ) -> None:
        span = [memoryview(buffer)[start:stop], self._MPI.BYTE]
        self._run("broadcast_bytes", budget, buffer, self._comm.Ibcast, span, root)

    def _buffer_bytes(self, buffer: bytearray) -> bytes:
        return bytes(buffer)

    def _lent_buffer(self, data: bytes | bytearray | None, total: int) -> bytearray:
        # The root's own bytearray is sent in place; an abandoned request keeps it alive.
        return data if isinstance(data, bytearray) else self._payload_buffer(
            None if data is None else bytes(data), total)

    def _owned_buffer(self, buffer: bytearray) -> bytearray:
        return buffer

    # -- all-gathers on large communicators: Bruck's algorithm, point to point ---------
    #
    # An MPI library's non-blocking all-gather(v) is often linear (Open MPI's libnbc:
    # every rank sends to and receives from every other), so each rank's messages, and
    # the memory its transport keeps per peer, grow with the job. Above
    # BRUCK_ABOVE ranks the all-gathers go point to point in ceil(log2 N) rounds: in
    # round k a rank sends what it holds (its own block and the next ones, up to 2**k)
    # to rank - 2**k and receives as much from rank + 2**k. Each round is polled
    # within the call's budget like any collective here; a round that times out
    # retires the communicator (its requests are kept alive, as for a collective).

    def _bruck(self, op: str, mine: bytes, sizes: list[int] | None, budget: Budget,
               tag: int) -> list[bytes]:
        """Every rank's block, in rank order. ``sizes``: each rank's block length
        (``None``: every block is ``len(mine)`` bytes long)."""
        MPI, comm, rank, size = self._MPI, self._comm, self._rank, self._size
        width = len(mine)
        held = [bytes(mine)]  # blocks of ranks rank, rank + 1, ... (mod size)
        dist, round_ = 1, 0
        while dist < size:
            count = min(dist, size - dist)
            send = bytearray(b"".join(held[:count]))
            source = (rank + dist) % size
            if sizes is None:
                expected = count * width
            else:
                expected = sum(sizes[(source + i) % size] for i in range(count))
            recv = bytearray(expected)
            try:
                requests = [comm.Irecv([recv, MPI.BYTE], source, tag + round_),
                            comm.Isend([send, MPI.BYTE], (rank - dist) % size, tag + round_)]
            except MPI.Exception as exc:
                raise self._comm_error(op, exc) from exc
            done = self._polled(functools.partial(MPI.Request.Testall, requests), op,
                                budget, [(r, (send, recv)) for r in requests])
            if not done:
                self._abandoned.extend((r, (send, recv)) for r in requests)
                raise self._timed_out(op, budget.seconds)
            at = 0
            for i in range(count):
                length = width if sizes is None else sizes[(source + i) % size]
                held.append(bytes(recv[at:at + length]))
                at += length
            dist <<= 1
            round_ += 1
        # held[i] is rank (rank + i) % size's block.
        return [held[(r - rank) % size] for r in range(size)]

    def _allgather_blocks(self, block: bytes, budget: Budget) -> list[Any]:
        if self._size > BRUCK_ABOVE:
            return self._bruck("allgather_object", block, None, budget, BRUCK_TAG)
        width = len(block)
        mine, out = bytearray(block), bytearray(width * self._size)
        BYTE = self._MPI.BYTE
        self._run("allgather_object", budget, (mine, out), self._comm.Iallgather,
                  [mine, BYTE], [out, BYTE])
        view = memoryview(out)
        return [view[i * width:(i + 1) * width] for i in range(self._size)]

    def _allgather_payloads(
        self, mine: bytes, lengths: list[int], budget: Budget
    ) -> list[memoryview]:
        total = sum(lengths)
        if total > MAX_MESSAGE_BYTES:
            raise self._too_large(
                f"{total} encoded bytes over all ranks exceed one MPI message ({MAX_MESSAGE_BYTES})"
            )
        if self._size > BRUCK_ABOVE:
            blocks = self._bruck("allgather_object", mine, lengths, budget, BRUCK_TAG + 64)
            return [memoryview(block) for block in blocks]
        displs = [0] * self._size
        for i in range(1, self._size):
            displs[i] = displs[i - 1] + lengths[i - 1]
        out = bytearray(total)
        send = bytearray(mine)
        BYTE = self._MPI.BYTE
        self._run(
            "allgather_object",
            budget,
            (send, out),
            self._comm.Iallgatherv,
            [send, BYTE],
            [out, (lengths, displs), BYTE],
        )
        view = memoryview(out)
        return [view[displs[i] : displs[i] + lengths[i]] for i in range(self._size)]

    def _barrier(self, budget: Budget) -> None:
        self._run("barrier", budget, None, self._comm.Ibarrier)

    def _split_child(self, colors: tuple[int, ...], color: int) -> Self:
        # MPI wants non-negative colors: number the distinct ones.
        mpi_color = sorted(set(colors)).index(color)
        try:
            child = self._comm.Split(mpi_color, self._rank)
        except self._MPI.Exception as exc:
            raise self._comm_error("split", exc) from exc
        # The ranks of this color, in rank order (the split's key is the rank).
        return self._child(child, [r for r, c in enumerate(colors) if c == color])

    def _child(self, child: Any, members: list[int]) -> Self:
        """``child`` (an MPI communicator over ``members``, this one's ranks in that
        order) as a communicator of this class that distcache owns, knowing its
        ranks' node keys where this one knows them."""
        made = type(self)(child, dup=False, **self._inherited())
        made._owned = True
        made._words = self._words
        if self._node_keys is not None:
            made._node_keys = [self._node_keys[r] for r in members]
        return made

    def node_keys(self) -> list[bytes] | None:
        """Every rank's :func:`node_key`, in rank order, where the arrival check before
        ``Dup`` carried them (no collective), or the communicator was made off one
        that knew them (``split``, :meth:`group_owned`); else None. Equal keys: the
        same node id."""
        return self._node_keys

    def group_owned(self, ranks: Sequence[int]) -> Self:
        """A communicator of the caller's own over ``ranks`` (ascending, this rank
        among them, numbered in that order), made by those ranks alone: collective
        over ``ranks`` only, so ranks outside them neither take part nor wait (a
        ``split`` takes every rank). As :meth:`split_owned`, :meth:`close` closes
        it. Call it once every rank of ``ranks`` is known to be here (``MPI_Comm_
        create_group`` blocks with no timeout).

        Raises:
            CommError: the MPI library refused.
            ValueError: ``ranks`` does not hold this rank, or is not ascending.
        """
        members = [int(r) for r in ranks]
        if self._rank not in members or members != sorted(set(members)):
            raise ValueError(f"rank {self._rank}: {members} must be ascending ranks "
                             "holding this one")
        group = self._comm.Get_group()
        try:
            subgroup = group.Incl(members)
            try:
                child = self._comm.Create_group(subgroup, GROUP_TAG)
            finally:
                subgroup.Free()
        except self._MPI.Exception as exc:
            raise self._comm_error("split", exc) from exc
        finally:
            group.Free()
        return self._keep_owned(self._child(child, members))

    def _release(self, why: str) -> None:
        # Free only a communicator distcache made, and only when no collective of its
        # is still pending: MPI would complete the abandoned one into freed state.
        comm, owned = self._comm, self._owned
        self._owned = False
        super()._release(why)
        if owned and not self._abandoned and comm != self._MPI.COMM_NULL:
            try:
                comm.Free()
            except self._MPI.Exception as exc:
                log.debug("freeing an MPI communicator failed: %s", exc)
