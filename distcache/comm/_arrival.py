"""The MPI arrival check before ``Dup``: every rank present, rank 0's word and every
rank's node, in one round up and down a binomial tree, point to point and polled
against a timeout (:func:`_arrive`).

A rank reports its arrival to its parent only once the parent has said it is there
(a "ready" each rank sends its children the moment it enters), so every arrival
reaches a parent that is present and polling, and the parent can age the time left
that the arrival carries from the moment it takes it: no rank reads another host's
clock, so hosts whose wall clocks disagree (no NTP) check alike."""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
from typing import Any

from distcache.comm._base import _longest_pause, poll_until
from distcache.errors import CollectiveTimeout

#: The point-to-point tag of the arrival check before ``Dup``. Point-to-point and
#: collective traffic never match each other in MPI, so the check cannot disturb a
#: collective the caller runs on the same communicator.
ARRIVAL_TAG = 0x4443

#: What each arrival carries up besides its check's nonce and the keys: the seconds
#: left, when sent, before the first rank of the sender's subtree gives up.
_LEFT = struct.Struct("!d")

#: Bytes of the nonce that names one rank's check to its children: its "ready" carries
#: it down and their arrivals carry it back, so a parent takes no arrival left over
#: from an earlier check on the same communicator.
_NONCE_BYTES = 8


def _margin(timeout: float, size: int) -> float:
    """The least time every rank must have left for rank 0 to send the word to go: the
    word travels ``log2(size)`` levels, each rank polling with pauses up to
    :func:`~distcache.comm._base._longest_pause` (and each arrival was aged from when
    its parent took it, up to one pause late per level); at least half a second, at
    most a quarter of ``timeout``."""
    levels = max(size - 1, 1).bit_length()
    return min(max(0.5, 2 * _longest_pause() * levels), timeout / 4)


def _deadline(figure: bytes) -> float:
    """A child's subtree deadline on this rank's monotonic clock, from the time left
    its arrival carried (:data:`_LEFT`), taken now: the child sent it only after this
    rank's "ready", so this rank was already polling and the arrival waited here no
    longer than a transit and a pause (which :func:`_margin` covers)."""
    (left,) = _LEFT.unpack(figure)
    return time.monotonic() + left


def _arrival_tree(rank: int, size: int) -> tuple[int | None, list[int]]:
    """``rank``'s parent (``None`` for rank 0) and children in a binomial tree.

    The subtree under a child ``c`` is the contiguous ranks ``[c, c + lowbit(c))``
    (clipped to ``size``), so a missing subtree is named by a range; every rank talks
    to at most ``log2(size) + 1`` others.
    """
    low = rank & -rank if rank else 1 << max(size - 1, 1).bit_length()
    parent = rank - low if rank else None
    children = []
    step = 1
    while step < low and rank + step < size:
        children.append(rank + step)
        step <<= 1
    return parent, children


def _subtree(child: int, size: int) -> str:
    last = _last(child, size)
    return str(child) if last == child else f"{child}-{last}"


#: Bytes of a rank's node key in the arrival check (:func:`node_key`).
NODE_KEY_BYTES = 8


def node_key(node_id: str) -> bytes:
    """A node id's fixed-width key: its SHA-256's first :data:`NODE_KEY_BYTES` bytes."""
    return hashlib.sha256(node_id.encode("utf-8", "surrogatepass")).digest()[:NODE_KEY_BYTES]


def _arrive(MPI: Any, base: Any, timeout: float, word: bytes = b"",
            key: bytes = bytes(NODE_KEY_BYTES)) -> tuple[bytes, list[bytes]]:
    """Return once every rank of ``base`` is here to ``Dup`` it, else raise; return
    rank 0's ``word`` (every rank passes one of the same length; rank 0's travels down
    with the word to go) and every rank's ``key`` in rank order (each subtree's keys
    travel up with its arrival, and the whole list down with the word to go): what
    rank 0 chose and where every rank runs reach every rank in this one round.

    ``Dup`` is a blocking collective with no timeout: a rank that called it alone
    would hang, and its pending ``Dup`` would be matched against the caller's next
    collective on ``base``. So every rank first reports arrival up a binomial tree
    and waits for the word that comes back down from rank 0, point to point, polled
    against ``timeout``; only then does anyone ``Dup``. A rank exchanges messages
    with at most ``log2(size) + 1`` others, so the check costs each rank the same
    number of messages at any job size (the keys make the word down
    ``NODE_KEY_BYTES`` bytes per rank). Timed-out receives and sends are cancelled,
    so a rank that came alone leaves as little as MPI lets it behind.

    A rank that gave up cannot take back an arrival already delivered, so each arrival
    also carries the time left before the first rank of its subtree gives up
    (:data:`_LEFT`), and rank 0 sends the word to go only while every rank has more
    than :func:`_margin` left for the word to reach it, else a word not to (as long),
    and then no rank calls ``Dup``. That figure is relative, and an arrival that sat
    queued at a parent not yet here could not be aged for its wait without comparing
    the two hosts' clocks, which need not agree. So on entering, each rank sends each
    child a "ready" at once (not waiting for its own parent: the handshake adds no
    level to the round), and a rank reports up only once it has its parent's ready
    and its whole subtree's arrivals: every arrival then reaches a parent already
    polling, which ages it from when it takes it (:func:`_deadline`).

    A ready carries a fresh nonce of its sender's, which the child's arrival repeats
    and the word to go it later sends that child carries too; a parent drops arrivals,
    and a child words, with another nonce: what an earlier, failed check on ``base``
    left queued (MPI need not cancel a send already delivered) is never taken for
    this one's. A child answers the latest ready it has taken (a later one means its
    parent began anew).

    Raises:
        CollectiveTimeout: not every rank arrived within ``timeout``, or some rank's
            wait ran out before the word to go could reach it.
    """
    rank, size = base.Get_rank(), base.Get_size()
    until = time.monotonic() + timeout
    parent, children = _arrival_tree(rank, size)
    width, nonce = NODE_KEY_BYTES, os.urandom(_NONCE_BYTES)
    head = 1 + _NONCE_BYTES + _LEFT.size
    # From each child: a byte, this rank's nonce, its subtree's time left (_LEFT),
    # then the keys of its subtree, [c, c + lowbit(c)).
    tokens = [bytearray(head + width * (_last(c, size) - c + 1)) for c in children]
    # From the parent, in turn: readies (a byte and its nonce), then the word to go (or
    # not): a byte, the parent's nonce, rank 0's word and every rank's key.
    down = 1 + _NONCE_BYTES + len(word) + width * size
    tokens.append(bytearray(down))
    ready = b"r" + nonce
    sent: list[tuple[Any, bytes]] = [  # sends and their buffers, kept until complete
        (base.Isend([ready, MPI.BYTE], child, ARRIVAL_TAG), ready) for child in children]
    from_children = [base.Irecv([tokens[i], MPI.BYTE], child, ARRIVAL_TAG)
                     for i, child in enumerate(children)]
    # When the first rank of this subtree gives up, on this rank's clock: the children's
    # deadlines, as they come in, and this rank's own.
    deadlines = {len(children): until}
    from_parent: list[Any] = []
    if parent is not None:
        from_parent.append(base.Irecv([tokens[-1], MPI.BYTE], parent, ARRIVAL_TAG))
    # The nonces of the parent's latest ready taken and of the last arrival sent up;
    # the word from rank 0, once it has come.
    state: dict[str, bytes | None] = {"ready": None, "reported": None, "word": None}

    def take_from_parent() -> None:
        got = tokens[-1]
        if got[:1] == b"r":
            state["ready"] = bytes(got[1:1 + _NONCE_BYTES])
        elif got[:1] in (b"g", b"x") and got[1:1 + _NONCE_BYTES] == state["reported"]:
            state["word"] = bytes(got)
            return
        # A ready, or a word left from an earlier check: wait for the next message.
        from_parent[0] = base.Irecv([got, MPI.BYTE], parent, ARRIVAL_TAG)

    def progressed() -> bool:
        # One message per peer per poll: leftovers of earlier checks are few, and a
        # peer that sent without end could not keep this rank from its deadline.
        for i, child in enumerate(children):
            if i not in deadlines and from_children[i].Test():
                if tokens[i][:1 + _NONCE_BYTES] == b"a" + nonce:
                    deadlines[i] = _deadline(bytes(tokens[i][1 + _NONCE_BYTES:head]))
                else:  # left from an earlier check: wait for this one's
                    from_children[i] = base.Irecv([tokens[i], MPI.BYTE], child,
                                                  ARRIVAL_TAG)
        if from_parent and state["word"] is None and from_parent[0].Test():
            take_from_parent()
        if len(deadlines) <= len(children):
            return False
        if parent is None:
            return True
        theirs = state["ready"]
        if theirs is not None and state["reported"] != theirs:
            # The whole subtree is here and the parent is too: report up.
            left = _LEFT.pack(min(deadlines.values()) - time.monotonic())
            up = b"a" + theirs + left + key + b"".join(bytes(t[head:]) for t in tokens[:-1])
            sent.append((base.Isend([up, MPI.BYTE], parent, ARRIVAL_TAG), up))
            state["reported"] = theirs
        return state["word"] is not None

    if not poll_until(progressed, until):
        missing = [_subtree(c, size) for i, c in enumerate(children) if i not in deadlines]
        for request in [*from_children, *from_parent, *(r for r, _ in sent)]:
            with contextlib.suppress(MPI.Exception):
                request.Cancel()
                request.Wait()
        where = (f"rank(s) {', '.join(missing)}" if missing
                 else "a rank elsewhere in the job" if parent is not None else "some rank")
        raise CollectiveTimeout(
            f"rank {rank}/{size}: {where} did not arrive within {timeout:g} s to "
            "make distcache's MPI communicator; every rank must call distcache.init (or "
            "the same collective) together",
            op="init", timeout=timeout, rank=rank, backend="mpi",
        )
    margin = _margin(timeout, size)
    if parent is None:
        keys = key + b"".join(bytes(t[head:]) for t in tokens[:-1])
        # Go only if the word reaches every rank before its wait runs out: a rank that
        # gave up after its arrival was sent must not leave the others in Dup.
        go = (b"g" if min(deadlines.values()) - time.monotonic() > margin
              else b"x") + nonce + word + keys
    else:  # passed on under this rank's nonce
        got = state["word"] or b""
        go = got[:1] + nonce + got[1 + _NONCE_BYTES:]
    for child in children:
        sent.append((base.Isend([go, MPI.BYTE], child, ARRIVAL_TAG), go))
    aborted = not go.startswith(b"g")
    # Every rank is here and polling: the sends complete at once; their buffers are
    # kept until they have.
    done = poll_until(lambda: MPI.Request.Testall([r for r, _ in sent]),
                      min(until, time.monotonic() + margin) if aborted else until)
    if not done:
        for request, _ in sent:  # cancelled, so that no later receive can match them
            with contextlib.suppress(MPI.Exception):
                request.Cancel()
                request.Wait()
    if aborted:
        raise CollectiveTimeout(
            f"rank {rank}/{size}: a rank's wait for the arrival check ran out before "
            "rank 0's word to go could reach it, so no rank makes distcache's MPI "
            "communicator: the job's ranks reached distcache.init (or the same "
            f"collective) too far apart for the {timeout:g} s timeout",
            op="init", timeout=timeout, rank=rank, backend="mpi")
    if not done:
        raise CollectiveTimeout(
            f"rank {rank}/{size}: a rank stopped in the arrival check before taking "
            "its word to go", op="init", timeout=timeout, rank=rank, backend="mpi")
    word, body = go[1 + _NONCE_BYTES:][:len(word)], go[1 + _NONCE_BYTES + len(word):]
    return word, [body[i:i + width] for i in range(0, width * size, width)]


def _last(child: int, size: int) -> int:
    """The last rank of ``child``'s subtree in the arrival tree."""
    return min(child + (child & -child), size) - 1
