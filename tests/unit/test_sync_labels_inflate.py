"""A peer's journal exchange is a few kilobytes of zlib that could inflate a
thousandfold: its labels are inflated to at most a manifest's size
(``MAX_MANIFEST_BYTES``), and past that refused as malformed, without the rest."""

from __future__ import annotations

import struct
import tracemalloc
import zlib

import pytest

from distcache.artifact import MAX_MANIFEST_BYTES
from distcache.collective._sync import decode_gained, encode_gained


def _bomb(inflated: int) -> bytes:
    """No digests, and labels of ``inflated`` newlines, compressed in pieces."""
    pack = zlib.compressobj(9)
    piece = b"\n" * (1 << 20)
    body = b"".join(pack.compress(piece) for _ in range(inflated // len(piece)))
    return struct.pack("<I", 0) + body + pack.flush()


def test_labels_that_inflate_past_a_manifest_are_refused_without_inflating_them() -> None:
    blob = _bomb(2 * MAX_MANIFEST_BYTES)
    assert len(blob) < 1 << 20  # what crosses the wire
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="exceed"):
            decode_gained(blob)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # At most the bound inflated and decoded once, never the whole bomb.
    assert peak < 2 * MAX_MANIFEST_BYTES + (32 << 20), peak


def test_labels_cut_short_are_refused() -> None:
    whole = encode_gained(["ab" * 32], {"pin/a.cubin": "ab" * 32})
    with pytest.raises(ValueError):
        decode_gained(whole[:-3])


def test_labels_within_the_bound_are_read() -> None:
    sha = "cd" * 32
    names = {f"pin/k{i}.cubin": sha for i in range(1000)}
    assert decode_gained(encode_gained([sha], names)) == ([sha], names)
    assert decode_gained(encode_gained([], {})) == ([], {})
