"""The CUDA pool's control words, on a CPU tensor: the pure part of the CUDA backend
that needs no device (the device paths run in scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from distcache.ipc._cuda import _TensorWords


@pytest.mark.parametrize(("slots", "consumers", "padding"), [(100, 2, 20), (1024, 3, 0), (7, 1, 3)])
def test_rows_read_each_slot_whatever_the_padding_after_the_table(
    slots: int, consumers: int, padding: int
) -> None:
    stride = 1 + consumers
    words = _TensorWords(torch.zeros(slots * stride + padding, dtype=torch.int32), stride)
    for slot in range(slots):
        words.set(slot * stride, slot + 1)  # the slot's generation
        for c in range(consumers):
            words.set(slot * stride + 1 + c, 1000 * (c + 1) + slot)  # each consumer's ack
    picked = [0, slots // 2, slots - 1]
    assert words.rows(picked, stride) == [
        [s + 1, *[1000 * (c + 1) + s for c in range(consumers)]] for s in picked
    ]
    assert words.rows(picked, 1) == [[s + 1] for s in picked]
    assert words.get((slots - 1) * stride) == slots
