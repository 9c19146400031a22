"""Shared pieces of the IPC wire formats (:mod:`distcache.ipc._ref`,
:mod:`distcache.ipc._descriptor`): the dtype table, bounds, and the decoding rule that
turns any failure on hostile bytes into an :class:`~distcache.errors.IpcError`."""

from __future__ import annotations

import operator
import re
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from distcache.errors import IpcError

#: dtype code -> (torch dtype name, itemsize). Codes are part of the wire format:
#: append, never renumber.
DTYPES: dict[int, tuple[str, int]] = {
    1: ("uint8", 1),
    2: ("int8", 1),
    3: ("int16", 2),
    4: ("int32", 4),
    5: ("int64", 8),
    6: ("float16", 2),
    7: ("bfloat16", 2),
    8: ("float32", 4),
    9: ("float64", 8),
    10: ("bool", 1),
    11: ("complex64", 8),
    12: ("uint16", 2),
    13: ("uint32", 4),
    14: ("uint64", 8),
    15: ("float8_e4m3fn", 1),
    16: ("float8_e5m2", 1),
}
DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}
_ITEMSIZE = dict(DTYPES.values())

MAX_NDIM = 16
#: Upper bound on any size or offset (256 TiB): keeps products far from overflow
#: surprises and rejects absurd forged values early.
MAX_BYTES = 1 << 48
MAX_GENERATION = 0x7FFFFFFF
#: The largest consumer rank a descriptor carries (one uint32 on the wire).
MAX_RANK = 0xFFFFFFFF
# \Z, not $: "$" also matches before a trailing newline ("pool\n" would pass).
_POOL_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")

BACKENDS = ("shm", "cuda")


def bad(what: str, pool_id: str | None = None, thing: str = "feature reference") -> IpcError:
    return IpcError(f"invalid {thing}: {what}", pool_id=pool_id)


_T = TypeVar("_T")


def decode(
    parse: Callable[[memoryview], _T], data: bytes | bytearray | memoryview, what: str
) -> _T:
    """Run ``parse`` over a private copy of ``data``; any decoding failure of forged or
    garbled bytes becomes an :class:`IpcError`, never another exception."""
    try:
        return parse(memoryview(bytes(data)))
    except IpcError:
        raise
    except (struct.error, ValueError, TypeError, UnicodeDecodeError, IndexError) as exc:
        raise bad(f"garbled {what} ({exc})", thing=what) from None


def check_int(name: str, value: Any, upper: int, pool_id: str | None,
              thing: str = "feature reference") -> None:
    if type(value) is not int or not 0 <= value <= upper:
        raise bad(f"{name}={value!r} must be an integer in [0, {upper}]", pool_id, thing)


def consumer_ranks(ranks: Any, pool_id: str | None) -> tuple[int, ...]:
    """``ranks`` as a tuple of consumer ranks: each an integer (not a bool, not a
    float) in ``[0, MAX_RANK]``.

    Raises:
        IpcError: ``ranks`` is not a sequence, or one of them is not a rank (named).
    """
    if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
        raise IpcError(
            f"consumers must be a sequence of ranks, got {ranks!r}", pool_id=pool_id
        )
    checked = []
    for value in ranks:
        try:
            rank = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            rank = -1
        if not 0 <= rank <= MAX_RANK:
            raise IpcError(
                f"consumer rank {value!r} is not an integer in [0, {MAX_RANK}]", pool_id=pool_id
            )
        checked.append(rank)
    return tuple(checked)


def check_pool_id(pool_id: Any) -> None:
    if not isinstance(pool_id, str) or not _POOL_ID_RE.match(pool_id):
        raise IpcError(
            f"invalid pool id {pool_id!r}: expected 1-64 characters of [A-Za-z0-9._-]",
            pool_id=None,
        )


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name from :data:`DTYPES`.

    Raises:
        IpcError: the dtype is not in the table.
    """
    try:
        return _ITEMSIZE[dtype]
    except (KeyError, TypeError):
        raise IpcError(f"unsupported dtype {dtype!r}; supported: {sorted(_ITEMSIZE)}") from None
