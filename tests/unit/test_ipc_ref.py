"""FeatureRef / PoolDescriptor wire format: round trips, and hostile bytes."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcache.errors import IpcError
from distcache.ipc import FeatureRef, PoolDescriptor
from distcache.ipc._ref import DTYPES, MAX_NDIM


def _descriptor(**changes: object) -> PoolDescriptor:
    fields: dict[str, object] = dict(
        pool_id="pool-a",
        backend="shm",
        owner=2,
        node_id="node0",
        epoch=123456789,
        capacity=1 << 20,
        data_start=1024,
        slots=16,
        ack_words=3,
        device=-1,
        consumers=(0, 1, 3),
        handle=b"distcache.store._pool-a.75bcd15",
    )
    fields.update(changes)
    return PoolDescriptor(**fields)  # type: ignore[arg-type]


def _ref(**changes: object) -> FeatureRef:
    fields: dict[str, object] = dict(
        pool_id="pool-a",
        epoch=123456789,
        offset=1024,
        nbytes=2 * 3 * 4,
        dtype="float32",
        shape=(2, 3),
        strides=(3, 1),
        slot=5,
        generation=7,
    )
    fields.update(changes)
    return FeatureRef(**fields)  # type: ignore[arg-type]


def test_ref_round_trips_through_pack() -> None:
    ref = _ref()
    data = ref.pack()
    assert data[:3] == b"DCR" and data[3] == 1
    assert FeatureRef.unpack(data) == ref
    assert len(data) < 100


def test_ref_carrying_its_descriptor_round_trips() -> None:
    ref = _ref(descriptor=_descriptor())
    assert FeatureRef.unpack(ref.pack()) == ref
    assert ref.without_descriptor() == _ref()


def test_descriptor_round_trips_through_pack() -> None:
    desc = _descriptor()
    assert PoolDescriptor.unpack(desc.pack()) == desc


@pytest.mark.parametrize("dtype", sorted(name for name, _ in DTYPES.values()))
def test_every_table_dtype_round_trips(dtype: str) -> None:
    size = dict(DTYPES.values())[dtype]
    ref = _ref(dtype=dtype, shape=(4,), strides=(1,), nbytes=4 * size)
    assert FeatureRef.unpack(ref.pack()).dtype == dtype


def test_zero_dim_and_empty_shapes_are_valid() -> None:
    assert FeatureRef.unpack(_ref(shape=(), strides=(), nbytes=4).pack()).shape == ()
    assert FeatureRef.unpack(_ref(shape=(0, 5), strides=(5, 1), nbytes=0).pack()).nbytes == 0


@pytest.mark.parametrize(
    "changes",
    [
        {"offset": -1},
        {"nbytes": 23},  # 2*3 float32 is 24 bytes
        {"dtype": "object"},
        {"shape": (2, -3), "nbytes": -24},
        {"strides": (3, -1)},
        {"strides": (4, 1)},  # reaches past nbytes
        {"shape": (1,) * (MAX_NDIM + 1), "strides": (1,) * (MAX_NDIM + 1), "nbytes": 4},
        {"generation": 0},
        {"generation": 1 << 31},
        {"pool_id": "../etc"},
        {"pool_id": ""},
        {"epoch": 1.5},
        {"descriptor": _descriptor(epoch=1)},  # names another epoch
    ],
)
def test_invalid_ref_fields_are_rejected(changes: dict[str, object]) -> None:
    with pytest.raises(IpcError):
        _ref(**changes)


def _set_byte(data: bytes, index: int, value: int) -> bytes:
    return data[:index] + bytes([value]) + data[index + 1 :]


@pytest.mark.parametrize(
    "forge",
    [
        lambda b: b"",
        lambda b: b[:-1],
        lambda b: b + b"\x00",
        lambda b: b"XXX" + b[3:],
        lambda b: _set_byte(b, 3, 2),  # version
        lambda b: _set_byte(b, 4, 0x80),  # unknown flag
        lambda b: _set_byte(b, 6 + 6 + 36, 200),  # dtype code
        lambda b: _set_byte(b, 6 + 6 + 37, 200),  # ndim
        lambda b: _set_byte(b, 5, 200),  # pool id length
    ],
)
def test_forged_bytes_raise_ipc_error(forge: object) -> None:
    data = _ref().pack()
    with pytest.raises(IpcError):
        FeatureRef.unpack(forge(data))  # type: ignore[operator]


def test_forged_nbytes_is_rejected() -> None:
    data = bytearray(_ref().pack())
    # pool id "pool-a" (6 bytes) follows the 6-byte head; nbytes sits after epoch+offset.
    struct.pack_into("<Q", data, 6 + 6 + 16, 1 << 40)
    with pytest.raises(IpcError, match="nbytes"):
        FeatureRef.unpack(bytes(data))


def test_non_bytes_input_raises_ipc_error() -> None:
    with pytest.raises(IpcError):
        FeatureRef.unpack("DCR")  # type: ignore[arg-type]


def _check_unpack(data: bytes) -> None:
    try:
        ref = FeatureRef.unpack(data)
    except IpcError:
        return
    assert FeatureRef.unpack(ref.pack()) == ref


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_unpack_of_random_bytes_is_an_ipc_error_or_a_valid_ref(data: bytes) -> None:
    _check_unpack(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=6),
    st.integers(-5, 5),
)
def test_unpack_of_mutated_refs_is_an_ipc_error_or_a_valid_ref(
    with_descriptor: bool, flips: list[tuple[int, int]], resize: int
) -> None:
    data = bytearray(_ref(descriptor=_descriptor() if with_descriptor else None).pack())
    for index, value in flips:
        if index < len(data):
            data[index] = value
    if resize < 0:
        del data[resize:]
    else:
        data += bytes(resize)
    _check_unpack(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_descriptor_unpack_of_random_bytes_is_an_ipc_error_or_valid(data: bytes) -> None:
    try:
        desc = PoolDescriptor.unpack(b"DCP\x01" + data)
    except IpcError:
        return
    assert PoolDescriptor.unpack(desc.pack()) == desc


def test_importing_distcache_ipc_does_not_import_torch() -> None:
    code = "import sys, distcache.ipc; sys.exit(1 if 'torch' in sys.modules else 0)"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    assert done.returncode == 0, "import distcache.ipc loaded torch"
