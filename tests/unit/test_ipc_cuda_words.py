"""The CUDA backend's pure parts, on the CPU: its control words (host memory laid out
as :mod:`distcache.ipc._layout` says, read in rows by reclaim), the backend part of its
descriptor, and what a pool without a driver says. The device paths (allocation,
export, stream-ordered ready/ack) run only in scripts/gpu_check.sh."""

from __future__ import annotations

import pytest

from distcache.errors import IpcError
from distcache.ipc import PoolDescriptor, probe_cuda_ipc
from distcache.ipc._devmap import pack_handle, unpack_handle
from distcache.ipc._layout import Layout, WordArray, audience_words


@pytest.mark.parametrize(("slots", "consumers"), [(100, 2), (1024, 3), (7, 1), (3, 63)])
def test_rows_read_each_slot_whatever_the_padding_after_the_table(
    slots: int, consumers: int
) -> None:
    # slots=100 with 2 consumers once crashed the device word table ("shape '[-1, 3]'
    # is invalid for input of size 320"): the header is padded to 256 bytes, so its
    # length is not a multiple of a row.
    layout = Layout(slots, consumers)
    memory = bytearray(layout.header_bytes)
    words = WordArray(memoryview(memory), layout.stride)
    for slot in range(slots):
        words.set(layout.ready(slot), slot + 1)
        for c in range(consumers):
            words.set(layout.ack(slot, c), 1000 * (c + 1) + slot)
    picked = [0, slots // 2, slots - 1]
    rows = words.rows(picked, layout.stride)
    assert [row[0] for row in rows] == [s + 1 for s in picked]
    assert [row[layout.ack_base :] for row in rows] == [
        [1000 * (c + 1) + s for c in range(consumers)] for s in picked
    ]
    assert words.get(layout.ready(slots - 1)) == slots
    # The consumer table sits after the last row and inside the header.
    assert layout.consumer(consumers - 1) + 3 <= layout.header_bytes // 4


def test_audience_words_set_one_bit_per_reader_across_words() -> None:
    assert audience_words([0], 1) == [1]
    assert audience_words([1, 33], 2) == [0b10, 0b10]
    assert audience_words(list(range(63)), 2) == [0xFFFFFFFF, 0x7FFFFFFF]


def test_cuda_handle_round_trips_and_rejects_garbage() -> None:
    ipc, uuid = bytes(range(64)), bytes(range(100, 116))
    packed = pack_handle(ipc, uuid, 1 << 20, 4096, "distcache.pool.1a")
    assert unpack_handle(packed) == (ipc, uuid, 1 << 20, 4096, "distcache.pool.1a")
    for bad in (packed[:-1], packed + b"x", packed[:50], b""):
        with pytest.raises(IpcError):
            unpack_handle(bad)


def test_cuda_descriptor_travels_as_bytes_with_an_outside_owner() -> None:
    layout = Layout(16, 3)
    desc = PoolDescriptor(
        pool_id="gpu-pool",
        backend="cuda",
        owner=None,
        node_id="node-a",
        epoch=7,
        capacity=1 << 20,
        data_start=layout.header_bytes,
        slots=16,
        ack_words=3,
        device=0,
        consumers=(0, 1, 2),
        handle=pack_handle(bytes(64), bytes(16), 1 << 20, 4096, "distcache.gpu-pool.7"),
    )
    assert PoolDescriptor.unpack(desc.pack()) == desc


def test_probe_says_why_when_no_driver_is_present() -> None:
    usable, reason = probe_cuda_ipc()
    # This suite runs on CPU-only machines; on a GPU machine the probe may say yes.
    assert usable or reason
    assert isinstance(reason, str)
