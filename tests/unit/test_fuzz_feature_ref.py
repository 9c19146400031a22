"""Forged FeatureRefs: decoding and resolving never read outside the segment.

Refs arrive from another process, so every field may be forged: offsets, sizes,
epochs, dtypes, ndim, shapes and strides that address anything. Decoding either
raises ``IpcError`` or yields a ref that satisfies its own invariants, and resolving a
decodable forgery against a real shared-memory pool either raises
``IpcError``/``StaleHandleError`` or returns a view that lies wholly inside the pool's
data region.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcache.errors import IpcError
from distcache.ipc import FeatureRef, PoolDescriptor, PoolRegistry, ShmPool
from distcache.ipc._ref import DTYPES, MAX_BYTES, MAX_NDIM, check_pool_id
from tests.support.helpers import run_group

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=400,
                suppress_health_check=[HealthCheck.too_slow])

CAPACITY = 1 << 16
SLOTS = 8


class Served:
    """One producer pool (rank 0) mapped by one consumer registry (rank 1); rank 2 is
    left for a registry of one example's own (one live mapping per consumer)."""

    def __init__(self) -> None:
        self.pool = ShmPool(CAPACITY, consumers=[1, 2], name="fuzzed", slots=SLOTS)
        self.pool.bind(owner=0, consumers=[1, 2])
        self.descriptor = self.pool.descriptor()
        self.registry = PoolRegistry(rank=1)
        self.registry.add(self.descriptor)
        tensors = [torch.arange(12, dtype=torch.float32).reshape(3, 4),
                   torch.arange(7, dtype=torch.int64),
                   torch.zeros(0, dtype=torch.uint8),
                   torch.ones(2, 2, 2, dtype=torch.float16)]
        self.refs = []
        for tensor in tensors:
            ref = self.pool.put(tensor, with_descriptor=False)
            assert ref is not None
            self.refs.append(ref)

    def close(self) -> None:
        self.registry.close()
        self.pool.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def assert_inside_data_region(view: torch.Tensor, desc: PoolDescriptor) -> None:
    """The bytes ``view`` can address lie in [data_start, data_start + capacity)."""
    storage = view.untyped_storage()
    base = storage.data_ptr()
    assert storage.nbytes() == desc.segment_bytes  # a view of the mapping, not a copy
    start = view.data_ptr()
    if view.numel() == 0:
        return
    reach = sum((d - 1) * s for d, s in zip(view.shape, view.stride(), strict=True))
    end = start + (reach + 1) * view.element_size()
    assert base + desc.data_start <= start and end <= base + desc.segment_bytes


# Values that sit on, around and far past every boundary of the served pool.
def near(*points: int) -> st.SearchStrategy[int]:
    return st.sampled_from(sorted({max(0, p + d) for p in points for d in (-1, 0, 1)})) | \
        st.integers(0, MAX_BYTES) | st.sampled_from([MAX_BYTES, MAX_BYTES + 1, 2**63, 2**64 - 1])


@FUZZ
@given(data=st.data())
def test_forged_fields_resolve_to_an_in_bounds_view_or_an_ipc_error(
    served: Served, data: st.DataObject
) -> None:
    desc = served.descriptor
    end = desc.data_start + desc.capacity
    base_ref = data.draw(st.sampled_from(served.refs))
    changes: dict[str, Any] = {}
    for name in data.draw(st.sets(st.sampled_from(
            ["offset", "nbytes", "shape", "strides", "dtype", "slot", "generation", "epoch"]))):
        if name in ("offset", "nbytes"):
            changes[name] = data.draw(near(0, desc.data_start, end, end - 256, CAPACITY))
        elif name in ("shape", "strides"):
            ndim = data.draw(st.integers(0, MAX_NDIM + 1))
            changes[name] = tuple(data.draw(st.lists(
                near(0, 1, 2, CAPACITY) | st.integers(-3, 3), min_size=ndim, max_size=ndim)))
        elif name == "dtype":
            changes[name] = data.draw(st.sampled_from([n for n, _ in DTYPES.values()]
                                                      + ["float128", "", "object"]))
        elif name == "slot":
            changes[name] = data.draw(near(0, SLOTS, 0xFFFFFFFF))
        elif name == "generation":
            changes[name] = data.draw(near(0, base_ref.generation, 0x7FFFFFFF))
        else:
            changes[name] = data.draw(near(desc.epoch, 0, 2**63 - 1))
    try:
        forged = replace(base_ref, **changes)
    except IpcError:
        return  # rejected by the ref's own checks
    assert FeatureRef.unpack(forged.pack()) == forged
    try:
        view = served.registry.resolve(forged)
    except IpcError:
        return  # StaleHandleError is an IpcError too
    assert_inside_data_region(view, desc)
    assert view.dtype == getattr(torch, forged.dtype)
    assert tuple(view.shape) == forged.shape


@FUZZ
@given(data=st.data())
def test_mutated_packed_refs_decode_to_valid_refs_or_an_ipc_error(
    served: Served, data: st.DataObject
) -> None:
    packed = bytearray(data.draw(st.sampled_from(served.refs)).pack())
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(packed) - 1))
        kind = data.draw(st.sampled_from(["byte", "u32", "u64", "cut", "grow"]))
        if kind == "byte":
            packed[at] = data.draw(st.integers(0, 255))
        elif kind == "u32" and at + 4 <= len(packed):
            packed[at:at + 4] = struct.pack("<I", data.draw(st.sampled_from(
                [0, 1, 0xFFFFFFFF, 0x80000000, MAX_NDIM + 1, len(DTYPES) + 1])))
        elif kind == "u64" and at + 8 <= len(packed):
            packed[at:at + 8] = struct.pack("<Q", data.draw(near(0, CAPACITY, MAX_BYTES)))
        elif kind == "cut":
            del packed[at:]
        else:
            packed[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        if not packed:
            break
    try:
        ref = FeatureRef.unpack(bytes(packed))
    except IpcError:
        return
    # Decodable: it holds its own invariants, and resolving it stays in bounds.
    for f in fields(ref):
        assert getattr(ref, f.name) is not None or f.name == "descriptor"
    assert FeatureRef.unpack(ref.pack()) == ref
    try:
        view = served.registry.resolve(ref)
    except IpcError:
        return
    assert_inside_data_region(view, served.descriptor)


@FUZZ
@given(
    capacity=st.sampled_from([CAPACITY, CAPACITY * 2, CAPACITY - 256, 256]),
    data_start_delta=st.sampled_from([0, -256, 256, 4096]),
    slots=st.sampled_from([SLOTS, 1, SLOTS * 64]),
    handle=st.sampled_from([None, b"distcache.other.1", b"../../etc/passwd", b"distcache.",
                            b"distcache.fuzzed\n", b"x" * 300]),
    epoch_delta=st.sampled_from([1, 0, -1]),
)
def test_forged_carried_descriptors_never_map_outside_a_segment(
    served: Served, capacity: int, data_start_delta: int, slots: int, handle: bytes | None,
    epoch_delta: int,
) -> None:
    # A fresh consumer per example: a forged newer epoch is remapped by design
    # (invalidate-and-retry), and must not disturb the other examples. It is rank 2:
    # rank 1's consumer is mapped by the fixture's registry, which is still open.
    registry = PoolRegistry(rank=2)
    try:
        registry.add(served.descriptor)
        real = served.descriptor
        try:
            forged_desc = replace(
                real, capacity=capacity, data_start=real.data_start + data_start_delta,
                slots=slots, handle=handle if handle is not None else real.handle,
                epoch=real.epoch + epoch_delta,
            )
            ref = replace(served.refs[0], epoch=forged_desc.epoch, descriptor=forged_desc)
        except IpcError:
            return
        try:
            view = registry.resolve(FeatureRef.unpack(ref.pack()))
        except IpcError:
            return
        # The carried descriptor is used only for an epoch that is not mapped yet.
        assert_inside_data_region(view, forged_desc if epoch_delta else real)
        del view  # never outlive the mapping (see the test below)
    finally:
        registry.close()


SEGFAULT_SCRIPT = """
from dataclasses import replace
import torch
from distcache.ipc import PoolRegistry, ShmPool
pool = ShmPool(1 << 16, consumers=[1], name="victim", slots=4)
pool.bind(owner=0, consumers=[1])
registry = PoolRegistry(rank=1)
registry.add(pool.descriptor())
ref = pool.put(torch.arange(12, dtype=torch.float32))
held = registry.resolve(ref)
newer = replace(pool.descriptor(), epoch=pool.epoch + 1)
try:
    registry.resolve(replace(ref, epoch=newer.epoch, descriptor=newer))
except Exception:
    pass
print(float(held.sum()))
del held
registry.close()
pool.close()
"""


def test_a_forged_newer_epoch_does_not_crash_a_consumer_holding_views() -> None:
    # A ref carrying a descriptor of a newer epoch makes the consumer remap and close
    # the old mapping; a view it still holds must stay readable (or the process must
    # at least not die of SIGSEGV).
    result = run_group([sys.executable, "-c", SEGFAULT_SCRIPT], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "66.0"


@pytest.mark.parametrize("pool_id", ["pool\n", "pool\r", "a" * 65, "", "a/b", "p\x00", "p\u00e9"])
def test_pool_ids_with_a_trailing_newline_or_other_junk_are_rejected(pool_id: str) -> None:
    # "$" in the old pattern matched before a final newline, so "pool\n" was accepted.
    with pytest.raises(IpcError):
        check_pool_id(pool_id)


def test_a_packed_pool_id_with_a_trailing_newline_does_not_decode(served: Served) -> None:
    packed = bytearray(served.refs[0].pack())
    id_len = packed[5]
    assert bytes(packed[6:6 + id_len]) == b"fuzzed"
    packed[6 + id_len - 1:6 + id_len] = b"\n"
    with pytest.raises(IpcError):
        FeatureRef.unpack(bytes(packed))
