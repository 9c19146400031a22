"""The MPI arrival check before ``Dup``: every rank present, rank 0's word and every
rank's node, in one round up and down a binomial tree, point to point and polled
against a timeout (:func:`_arrive`)."""

from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any

from distcache.comm._base import poll_until
from distcache.errors import CollectiveTimeout

#: The point-to-point tag of the arrival check before ``Dup``. Point-to-point and
#: collective traffic never match each other in MPI, so the check cannot disturb a
#: collective the caller runs on the same communicator.
ARRIVAL_TAG = 0x4443

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
    (once its whole subtree has reported) and waits for the word that comes back
    down from rank 0, point to point, polled against ``timeout``; only then does
    anyone ``Dup``. A rank exchanges messages with at most ``log2(size) + 1`` others,
    so the check costs each rank the same number of messages at any job size (the
    keys make the word down ``NODE_KEY_BYTES`` bytes per rank). A timed-out receive
    is cancelled, so a rank that came alone leaves nothing behind that a later
    collective could match.

    Raises:
        CollectiveTimeout: not every rank arrived within ``timeout``.
    """
    rank, size = base.Get_rank(), base.Get_size()
    until = time.monotonic() + timeout
    parent, children = _arrival_tree(rank, size)
    width = NODE_KEY_BYTES
    # From each child: a byte, then the keys of its subtree, [c, c + lowbit(c)).
    tokens = [bytearray(1 + width * (_last(c, size) - c + 1)) for c in children]
    tokens.append(bytearray(1 + len(word) + width * size))  # the word to go
    from_children = [base.Irecv([tokens[i], MPI.BYTE], child, ARRIVAL_TAG)
                     for i, child in enumerate(children)]
    from_parent: list[Any] = []
    sent: list[tuple[Any, bytes]] = []  # sends and their buffers, kept until complete

    def progressed() -> bool:
        if not MPI.Request.Testall(from_children):
            return False
        if parent is None:
            return True
        if not from_parent:
            # The whole subtree is here: report up, then wait for the word.
            up = b"a" + key + b"".join(bytes(t[1:]) for t in tokens[:-1])
            sent.append((base.Isend([up, MPI.BYTE], parent, ARRIVAL_TAG), up))
            from_parent.append(base.Irecv([tokens[-1], MPI.BYTE], parent, ARRIVAL_TAG))
        return bool(MPI.Request.Testall(from_parent))

    if not poll_until(progressed, until):
        missing = [_subtree(c, size) for c, req in zip(children, from_children, strict=True)
                   if not req.Test()]
        waited_parent = bool(from_parent) and not from_parent[0].Test()
        for request in [*from_children, *from_parent, *(r for r, _ in sent)]:
            with contextlib.suppress(MPI.Exception):
                request.Cancel()
                request.Wait()
        where = (f"rank(s) {', '.join(missing)}" if missing
                 else "a rank elsewhere in the job" if waited_parent else "some rank")
        raise CollectiveTimeout(
            f"rank {rank}/{size}: {where} did not arrive within {timeout:g} s to "
            "make distcache's MPI communicator; every rank must call distcache.init (or "
            "the same collective) together",
            op="init", timeout=timeout, rank=rank, backend="mpi",
        )
    if parent is None:
        keys = key + b"".join(bytes(t[1:]) for t in tokens[:-1])
        go = b"g" + word + keys
    else:
        go = bytes(tokens[-1])
    for child in children:
        sent.append((base.Isend([go, MPI.BYTE], child, ARRIVAL_TAG), go))
    # Every rank is here and polling: the sends complete at once; their buffers are
    # kept until they have.
    if not poll_until(lambda: MPI.Request.Testall([r for r, _ in sent]), until):
        for request, _ in sent:  # cancelled, so that no later receive can match them
            with contextlib.suppress(MPI.Exception):
                request.Cancel()
                request.Wait()
        raise CollectiveTimeout(
            f"rank {rank}/{size}: a rank stopped in the arrival check before taking "
            "its word to go", op="init", timeout=timeout, rank=rank, backend="mpi")
    body = go[1 + len(word):]
    return go[1:1 + len(word)], [body[i:i + width] for i in range(0, width * size, width)]


def _last(child: int, size: int) -> int:
    """The last rank of ``child``'s subtree in the arrival tree."""
    return min(child + (child & -child), size) - 1


