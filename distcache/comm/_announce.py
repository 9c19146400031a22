"""A rank's own failure told to the other ranks at once, over MPI.

Every collective here waits for every rank until its deadline (``DISTCACHE_TIMEOUT``,
ten minutes by default). A rank that fails on its own (its pool directory cannot be
made on one node, a bad setting there, an interrupt) would leave the others waiting
that long and then raising a timeout that cannot say why. Where distcache owns the
MPI communicator (the ``Dup`` it works on), such a rank sends a short word on it,
point to point, before it lets go: to rank 0, which passes it on to every other rank
(rank 0's own failure goes to every rank at once). Every wait of that communicator,
and of those made from it (the node tree's), looks for the word and raises the
failure it names (its class, its message, the rank and node it came from) instead of
waiting on.

Nothing is added where nothing fails: no round, and a wait shorter than
:data:`FIRST_LOOK_S` never looks; a longer one looks with one matched probe, at
gaps that grow with the wait (a tenth of the time waited, at most
:data:`LONGEST_GAP_S`). Only rank 0 passes words on, so any number of failing ranks
send one word each. A word reaches the ranks only while rank 0 is still waiting in
one of the communicator's collectives (it is, until every rank has arrived).

The word is ``(rank, node id, description)`` in the wire codec (the description is
:func:`~distcache.comm._base.describe_error`'s, never a pickle), at most
:data:`MAX_WORD_BYTES` long: a longer message is cut to fit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from distcache._log import get_logger
from distcache.comm._base import describe_error, described_error, poll_until
from distcache.comm._codec import decode, encode
from distcache.errors import CollectiveTimeout, CommError, DistcacheError, WireError

log = get_logger(__name__)

#: The point-to-point tag of a word, on distcache's own duplicate of the communicator.
ANNOUNCE_TAG = 0x4441
#: The longest word sent or taken, in bytes.
MAX_WORD_BYTES = 4096
#: A wait looks for a word once it has lasted this long, then at growing gaps ...
FIRST_LOOK_S = 0.02
#: ... of at most this long.
LONGEST_GAP_S = 0.5
#: How long a failing rank waits for its words to leave before it goes on failing.
SEND_WAIT_S = 2.0


def to_announce(error: BaseException, rank: int) -> bool:
    """Whether ``error``, raised on ``rank``, is one to tell the others: its own (not
    one it heard of or that every rank raised alike, ``agreed``), and not a timeout
    or a transport failure, nor raised from one, which the others meet for
    themselves."""
    if isinstance(error, GeneratorExit | SystemExit) or getattr(error, "agreed", False):
        return False
    cause: BaseException | None = error
    while cause is not None:  # also a collective's error raised from the transport's
        if isinstance(cause, CollectiveTimeout | CommError):
            return False
        cause = cause.__cause__
    return getattr(error, "rank", None) in (None, rank)


def tell_others(comm: Any, error: BaseException) -> bool:
    """Tell the other ranks of ``comm`` that this one failed with ``error``, where
    :func:`to_announce` says to and the communicator can (an MPI one distcache owns, or
    a wrapper that forwards ``announce`` to one: a node tree, a counting one); True when
    told. Never raises."""
    try:
        announce = getattr(comm, "announce", None)
        if announce is None or comm.size < 2 or not to_announce(error, comm.rank):
            return False
        return bool(announce(error))
    except Exception as exc:  # the caller's own failure is what it raises
        log.debug("could not tell the other ranks of a failure: %s", exc)
        return False


def watched(test: Callable[[], Any], look: Callable[[], None]) -> Callable[[], bool]:
    """``test`` for a wait that also calls ``look`` (an :meth:`Announcements.looker`)
    each time ``test`` is not yet true."""

    def done() -> bool:
        if test():
            return True
        look()
        return False

    return done


class Announcements:
    """The words of one communicator (``comm``, an ``mpi4py`` communicator private to
    distcache, of ``size`` ranks; ``mpi``: the ``mpi4py.MPI`` module) for its waits and
    for the waits of every communicator made from it, from any thread."""

    def __init__(self, mpi: Any, comm: Any, rank: int, size: int, node_id: str) -> None:
        self._MPI, self._comm = mpi, comm
        self._rank, self._size, self._node_id = rank, size, node_id
        self._lock = threading.Lock()
        self._heard: tuple[int, str, Any] | None = None
        self._told = False
        # Sends and their buffers, kept alive until MPI is done with them.
        self._sent: list[tuple[Any, bytearray]] = []

    @property
    def spent(self) -> str | None:
        """What retires the communicators that share these words (None: nothing): a
        failure was heard of or told. A communicator whose waits stopped at a failure
        has collectives pending for ever, and a rank that told once tells no more."""
        if self._heard is not None:
            rank, node, _ = self._heard
            return f"rank {rank}/{self._size} ({node}) failed"
        if self._told:
            return f"rank {self._rank}/{self._size} ({self._node_id}, this rank) failed"
        return None

    def looker(self) -> Callable[[], None]:
        """A function one wait calls at each poll: raises the failure a word named,
        looking for one only as the module says."""
        began = time.monotonic()
        due = began + FIRST_LOOK_S

        def look() -> None:
            nonlocal due
            if self._heard is None:
                now = time.monotonic()
                if now < due:
                    return
                due = now + min(LONGEST_GAP_S, max(FIRST_LOOK_S, (now - began) * 0.1))
                self._take()
            if self._heard is not None:
                raise self._failure()

        return look

    def _take(self) -> None:
        """Take a word that has come, if any (rank 0 passes it on)."""
        MPI = self._MPI
        with self._lock:
            if self._heard is not None:
                return
            status = MPI.Status()
            message = self._comm.Improbe(MPI.ANY_SOURCE, ANNOUNCE_TAG, status)
            if message is None:
                return
            source, count = status.Get_source(), status.Get_count(MPI.BYTE)
            buffer = bytearray(min(max(count, 0), MAX_WORD_BYTES))
            try:
                message.Recv([buffer, MPI.BYTE])
            except MPI.Exception as exc:  # longer than any word: truncated
                raise self._bad(source, f"{count} bytes long ({exc})") from None
            try:
                word = decode(buffer)
            except WireError as exc:
                raise self._bad(source, f"not in the wire codec ({exc})") from None
            if not (type(word) is tuple and len(word) == 3 and type(word[0]) is int
                    and 0 <= word[0] < self._size and type(word[1]) is str):
                raise self._bad(source, "not a (rank, node id, description) triple")
            if isinstance(described_error(word[2], word[0], self._size, word[1]), str):
                raise self._bad(source, "not an error's description")
            self._heard = word
            if self._rank == 0 and not self._told:
                self._told = True
                self._send(buffer, [r for r in range(1, self._size)
                                    if r not in (source, word[0])])

    def _failure(self) -> DistcacheError:
        """A fresh error for the failure heard of (each wait raises its own)."""
        assert self._heard is not None
        rank, node, description = self._heard
        rebuilt = described_error(description, rank, self._size, node)
        assert not isinstance(rebuilt, str), "checked when the word was taken"
        if type(description[2]) is str:  # one of distcache's: say where it came from
            rebuilt.args = (f"rank {rank}/{self._size} ({node}) failed, so rank "
                            f"{self._rank} stops: {rebuilt.message}",)
            for name, value in (("rank", rank), ("host", node)):
                if name in rebuilt.declared() and getattr(rebuilt, name, None) is None:
                    setattr(rebuilt, name, value)
        # Every rank the word reached raises it (set here: described_error built it).
        rebuilt.agreed = True
        return rebuilt

    def _bad(self, source: int, what: str) -> WireError:
        return WireError(
            f"rank {self._rank}/{self._size} ({self._node_id}): a failure word from rank "
            f"{source} is {what}; check that every rank runs the same distcache",
            op="announce", rank=self._rank, backend="mpi", peer=source)

    def announce(self, error: BaseException) -> bool:
        """Tell the other ranks that this one failed with ``error`` (see the module);
        True when words were sent. Never raises: a failure to tell is logged."""
        with self._lock:
            if self._told or self._heard is not None or self._size < 2:
                return False
            self._told = True
        try:
            word = _word(self._rank, self._node_id, error)
            self._send(bytearray(word), [0] if self._rank else list(range(1, self._size)))
            requests = [request for request, _ in self._sent]
            if not poll_until(lambda: bool(self._MPI.Request.Testall(requests)),
                              time.monotonic() + SEND_WAIT_S):
                log.debug("rank %d: a failure word had not left after %.0f s",
                          self._rank, SEND_WAIT_S)
            return True
        except Exception as exc:  # the failure itself is what the caller raises
            log.warning("rank %d could not tell the other ranks it failed: %s",
                        self._rank, exc)
            return False

    def _send(self, buffer: bytearray, ranks: list[int]) -> None:
        for rank in ranks:
            self._sent.append(
                (self._comm.Isend([buffer, self._MPI.BYTE], rank, ANNOUNCE_TAG), buffer))


def _word(rank: int, node_id: str, error: BaseException) -> bytes:
    """The word for ``error``, its message cut to fit :data:`MAX_WORD_BYTES`."""
    type_name, text, kind, attrs = describe_error(error)
    room = len(text)
    while True:
        shown = text if room >= len(text) else text[:room] + " [...]"
        word = encode((rank, node_id, (type_name, shown, kind, attrs)))
        if len(word) <= MAX_WORD_BYTES:
            return word
        if room == 0:  # the attributes alone are too long
            return encode((rank, node_id, (type_name, shown, kind, {})))
        room = max(0, min(room, len(text)) - (len(word) - MAX_WORD_BYTES) - 16)
