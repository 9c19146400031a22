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
"""

from __future__ import annotations

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
