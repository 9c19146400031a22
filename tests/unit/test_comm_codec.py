"""The wire form of all-gathered objects: plain data round-trips, anything else is
refused at the sender, and no byte string a peer sends is ever more than data."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import pickle
import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcache.comm._codec import MAGIC, MAX_DEPTH, MAX_INT_BITS, VERSION, decode, encode
from distcache.errors import CommError, WireError

_ints = st.integers(min_value=-(1 << MAX_INT_BITS) + 1, max_value=(1 << MAX_INT_BITS) - 1)
_scalars = (
    st.none() | st.booleans() | _ints | st.floats(allow_nan=False)
    | st.text() | st.binary()
)
_keys = st.text(max_size=8) | _ints
plain = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(_keys, inner, max_size=5)
    ),
    max_leaves=30,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same type at every level (so ``1 == 1.0 == True`` and a list
    equal to a tuple do not pass)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


# -- round trips --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain)
def test_every_plain_value_round_trips_with_its_types(value: Any) -> None:
    data = encode(value)
    assert data[:2] == bytes((MAGIC, VERSION))
    assert _same(decode(data), value)


def test_tuples_stay_tuples_lists_stay_lists_and_bools_stay_bools() -> None:
    value: list[Any] = [(1, [2, (3,)]), [True, 1, 1.0], {"k": (), 7: []}, None]
    back = decode(encode(value))
    assert _same(back, value)
    assert type(back[0]) is tuple and type(back[0][1]) is list and back[1][0] is True


def test_byte_buffers_arrive_as_bytes_and_floats_keep_their_bits() -> None:
    back = decode(encode([bytearray(b"ab"), memoryview(b"cd"), b""]))
    assert back == [b"ab", b"cd", b""] and all(type(b) is bytes for b in back)
    for x in (0.0, -0.0, math.inf, -math.inf, 5e-324, 1.7976931348623157e308):
        assert math.copysign(1, decode(encode(x))) == math.copysign(1, x)
        assert decode(encode(x)) == x
    assert math.isnan(decode(encode(math.nan)))


def test_strings_with_lone_surrogates_and_the_widest_ints_round_trip() -> None:
    for value in ("\udc80x", "é\U0001f600", (1 << MAX_INT_BITS) - 1, -(1 << MAX_INT_BITS) + 1):
        assert decode(encode(value)) == value


def test_the_encoding_is_smaller_than_a_pickle_for_the_collectives_payloads() -> None:
    # What prefetch all-gathers: a digest, counts, a pool id, a node id; a failure record.
    agree = ("ab" * 32, 4000, "a1b2c3d4e5f60718", "gpu017")
    failure = ("fetch", "cubins/x.cubin", 3, "gpu017", "OriginError: 404")
    for value in (agree, failure, (b"\xff" * 500, None)):
        assert len(encode(value)) < len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


# -- refusal at the sender ----------------------------------------------------------------


@dataclasses.dataclass
class Report:
    count: int


class Color(enum.IntEnum):
    RED = 1


class Pair(NamedTuple):
    a: int
    b: int


class Text(str):
    pass


@pytest.mark.parametrize(
    ("value", "type_name", "where"),
    [
        (Report(1), "test_comm_codec.Report", "the payload itself"),
        ({1, 2}, "set", "the payload itself"),
        (frozenset(), "frozenset", "the payload itself"),
        (Color.RED, "test_comm_codec.Color", "the payload itself"),
        (Pair(1, 2), "test_comm_codec.Pair", "the payload itself"),
        (Text("x"), "test_comm_codec.Text", "the payload itself"),
        (ValueError("x"), "ValueError", "the payload itself"),
        (print, "builtin_function_or_method", "the payload itself"),
        (object(), "object", "the payload itself"),
        (1j, "complex", "the payload itself"),
        ([1, {"a": (2, Report(3))}], "test_comm_codec.Report", "[1]['a'][1]"),
        ({(1, 2): "tuple key"}, "tuple", "the payload itself"),
        ({"ok": {1.5: "float key"}}, "float", "['ok']"),
        (1 << MAX_INT_BITS, "int", "the payload itself"),
    ],
)
def test_a_value_that_is_not_plain_data_is_refused_naming_its_type_and_place(
    value: Any, type_name: str, where: str
) -> None:
    with pytest.raises(WireError) as info:
        encode(value)
    err = info.value
    assert isinstance(err, CommError) and isinstance(err, ValueError)
    assert err.type_name.endswith(type_name), err.type_name  # type: ignore[attr-defined]
    assert err.op == "encode"  # type: ignore[attr-defined]
    assert f"at {where}:" in str(err), str(err)
    assert "cross ranks" in str(err)


def test_nesting_too_deep_and_a_list_that_contains_itself_are_refused() -> None:
    deep: Any = 0
    for _ in range(MAX_DEPTH):
        deep = [deep]
    assert decode(encode(deep)) == deep  # exactly the limit passes
    with pytest.raises(WireError, match="deeper than"):
        encode([deep])
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(WireError, match="deeper than"):
        encode(loop)


# -- what a peer may send ------------------------------------------------------------------


class _Marker:
    """Unpickling this creates ``path``: proof that a payload's code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_a_pickle_whose_reduce_runs_code_is_refused_and_its_code_never_runs(
    tmp_path: Path,
) -> None:
    control, marker = tmp_path / "control", tmp_path / "marker"
    pickle.loads(pickle.dumps(_Marker(control)))
    assert control.exists(), "the payload would run code if it were unpickled"
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        evil = pickle.dumps([_Marker(marker)], protocol=proto)
        with pytest.raises(WireError, match=r"not a distcache payload.*a pickle\?"):
            decode(evil)
        # Behind a forged header too: the bytes are read as data, never loaded.
        forged = bytes((MAGIC, VERSION)) + evil
        with pytest.raises(WireError, match="malformed payload"):
            decode(forged)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not a distcache payload"),
        (b"\x80\x05K\x01.", "a pickle"),
        (bytes([MAGIC]), "before its version byte"),
        (bytes([MAGIC, VERSION + 1, 0]), f"version {VERSION + 1}"),
        (bytes([MAGIC, 0, 0]), "version 0"),
        (bytes([MAGIC, VERSION]), "ends early"),
        (bytes([MAGIC, VERSION, 0, 0]), "1 bytes after the value"),
        (bytes([MAGIC, VERSION, 0x63]), "unknown tag 0x63"),
        (bytes([MAGIC, VERSION, 5, 5, 0x61]), "5 bytes announced, 1 left"),
        (bytes([MAGIC, VERSION, 5, 2, 0xFF, 0xFE]), "not UTF-8"),
        (bytes([MAGIC, VERSION, 7]) + b"\xff" * 9 + b"\x01", "items announced"),
        (bytes([MAGIC, VERSION, 7]) + b"\xff" * 11, "longer than 10 bytes"),
        (bytes([MAGIC, VERSION, 3]) + b"\xff" * 40 + b"\x01", "a number longer than"),
        (bytes([MAGIC, VERSION, 9, 1, 0, 0]), "dict key of type NoneType"),
        (bytes([MAGIC, VERSION, 9, 2, 3, 2, 0, 3, 2, 0]), "dict key 1 twice"),
        (bytes([MAGIC, VERSION, 4, 0, 0]), "announced"),
        (bytes([MAGIC, VERSION]) + bytes([7, 1]) * 5000 + b"\x00", "deeper than"),
    ],
)
def test_a_malformed_payload_is_a_wire_error(data: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match) as info:
        decode(data)
    assert info.value.op == "decode"  # type: ignore[attr-defined]


def test_every_truncation_of_a_valid_payload_is_a_wire_error() -> None:
    data = encode([None, True, -(1 << 70), 2.5, "txt", b"raw", (1,), {"k": [1, {2: b""}]}])
    for cut in range(len(data)):
        with pytest.raises(WireError):
            decode(data[:cut])


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_after_the_header_are_a_value_or_a_wire_error(tail: bytes) -> None:
    try:
        value = decode(bytes((MAGIC, VERSION)) + tail)
    except WireError:
        return
    encode(value)  # whatever decodes is plain data again


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plain, st.randoms(use_true_random=False))
def test_flipped_bytes_in_a_valid_payload_are_a_value_or_a_wire_error(
    value: Any, rng: random.Random
) -> None:
    data = bytearray(encode(value))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    try:
        back = decode(bytes(data))
    except WireError:
        return
    encode(back)


def test_a_memoryview_of_a_larger_buffer_decodes_only_its_own_bytes() -> None:
    # MPI hands each rank's part over as a view into one receive buffer.
    a, b = encode("first"), encode(["second", 2])
    buffer = memoryview(a + b)
    assert decode(buffer[: len(a)]) == "first"
    assert decode(buffer[len(a):]) == ["second", 2]
