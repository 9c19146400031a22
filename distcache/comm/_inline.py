"""Small collectives in one round: a payload's first bytes travel with its length.

An all-gather of objects must learn every rank's length before it can place the
payloads, and a broadcast's receivers must learn the root's; sent alone, the lengths
are a round of their own, and start-up is dozens of small collectives. Here every
rank sends a fixed-width *head* instead: its payload's length (8 bytes, little-endian,
unsigned) and the payload's first ``width`` bytes, zero-padded. When every payload
fits its head, that one round is the whole collective; otherwise a second round
carries what lies past each head. Every rank reads the same lengths, so every rank
takes the same path.

The width is at most :data:`INLINE_MAX`, and at most :data:`INLINE_TOTAL` bytes over
all ranks of an all-gather: heads never make a rank receive more than 64 KiB more
than it did, and at 8,192 ranks and more a head is the length alone.

A broadcast's receivers take the root's length as a claim, never as an order: one
past what they accept (:func:`refusal`) is refused on every rank before any rank
allocates for it, so a corrupt root, or a root of another job on a shared transport,
cannot make every rank allocate what it announces.
"""

from __future__ import annotations

import functools
import os

from distcache.errors import WireError

#: Bytes of a head that hold the payload's length.
HEAD = 8
#: The most payload bytes one head carries.
INLINE_MAX = 4096 - HEAD
#: The most bytes the heads of one all-gather add up to, over all ranks.
INLINE_TOTAL = 1 << 16


def inline_width(size: int) -> int:
    """Payload bytes each head of an all-gather over ``size`` ranks carries."""
    return max(0, min(INLINE_MAX, INLINE_TOTAL // max(size, 1) - HEAD))


def head(payload: bytes | bytearray, width: int) -> bytes:
    """``payload``'s head: its length, then its first ``width`` bytes, zero-padded."""
    part = bytes(payload[:width])
    return len(payload).to_bytes(HEAD, "little") + part + bytes(width - len(part))


def length_of(block: bytes | bytearray | memoryview) -> int:
    """The payload length a head carries."""
    return int.from_bytes(block[:HEAD], "little")


def carried(block: bytes | bytearray | memoryview, length: int, width: int) -> memoryview:
    """The payload bytes a head carries: its first ``min(length, width)``."""
    return memoryview(block)[HEAD:HEAD + min(length, width)]


def check_most(most: int | None) -> None:
    """The check of a broadcast's ``max_bytes`` before it communicates.

    Raises:
        ValueError: ``most`` is neither None nor a number of bytes >= 0.
    """
    if most is not None and (type(most) is not int or most < 0):
        raise ValueError(f"max_bytes must be a number of bytes >= 0 or None, got "
                         f"{most!r:.40}; pass the largest payload the broadcast expects")


def accepted(most: int | None, lend: bool, control: int) -> tuple[int, str]:
    """What a broadcast's receiver accepts, and why: the caller's ``most``; else, for
    bulk data (``lend``: an artifact of a known size may be larger than any default),
    what this host's memory could hold at all; else ``control``, the default cap."""
    if most is not None:
        return most, "the max_bytes this call passed"
    if lend:
        return _memory(), "this host's memory: no larger payload could be received"
    return control, ("the default cap, DISTCACHE_MAX_ARTIFACT_BYTES + "
                     "DISTCACHE_BUCKET_BYTES; raise either if payloads this large are meant")


def refusal(total: int, most: int, root: int, rank: int, size: int, where: str, *,
            backend: str, why: str) -> WireError | None:
    """The error rank ``rank`` of ``size`` (on ``where``) raises for a broadcast whose
    head, from ``root``, announces ``total`` bytes, more than the ``most`` it accepts
    (``why``: :func:`accepted`); None within it. Every rank read the same head, the root
    too, so every rank that accepts alike raises alike and none is left waiting for
    chunks."""
    if total <= most:
        return None
    who = "this rank, the root, holds" if rank == root else f"root rank {root} announced"
    return WireError(
        f"broadcast_bytes on rank {rank}/{size} ({where}): {who} a payload of {total} "
        f"bytes, more than the {most} this rank accepts ({why}); nothing was received. "
        "Check that every rank of the communicator belongs to this job and runs the same "
        "distcache; the communicator is unusable now", op="broadcast_bytes", rank=rank,
        backend=backend, peer=root)


@functools.cache
def _memory() -> int:
    """This host's physical memory in bytes, read once."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 1 << 62
