"""The wire form of everything a communicator all-gathers: plain data, never code.

A peer's payload is data to parse, not a program to run: a pickle would execute
whatever a forged payload names, and the rendezvous stores distcache's groups meet
on are reachable by anyone who can reach the node. So payloads are a small tagged binary format of plain types only::

    payload = MAGIC VERSION value
    value   = NONE | FALSE | TRUE
            | INT varint(zigzag(n))          (at most MAX_INT_BITS bits)
            | FLOAT 8 bytes (IEEE 754, big-endian)
            | STR varint(len) utf-8           (lone surrogates pass through)
            | BYTES varint(len) raw           (bytes, bytearray or memoryview sent)
            | LIST varint(n) value*n | TUPLE varint(n) value*n
            | DICT varint(n) (key value)*n    (keys: str or int, no duplicates)

Types are matched exactly: a subclass (an enum, a named tuple, a dataclass) is
refused at the sender, naming its type and where it sits, rather than arriving as
something else. Structured objects cross ranks as tuples or dicts and are rebuilt by
the receiver (``dataclasses.asdict``, an error's description in
:func:`~distcache.comm._base.agree_on_error`, a descriptor's ``pack()``).

Decoding treats its input as hostile: every length is checked against the bytes
left, nesting is bounded, trailing bytes are refused, and any failure is a
:class:`~distcache.errors.WireError`, never another exception.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Iterable
from typing import Any

from distcache.errors import WireError

#: First byte of every payload: not a pickle opcode (a pickle starts with 0x80).
MAGIC = 0xDC
#: The format's version; a reader refuses any other (ranks must run one distcache).
VERSION = 1
#: Deepest nesting of lists, tuples and dicts either side accepts.
MAX_DEPTH = 64
#: Largest magnitude of an int, in bits.
MAX_INT_BITS = 256

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _BYTES, _LIST, _TUPLE, _DICT = range(10)
_HEADER = bytes((MAGIC, VERSION))
_DOUBLE = struct.Struct(">d")
# A zigzag varint of MAX_INT_BITS bits (plus the sign bit) fits in this many bytes.
_MAX_INT_BYTES = (MAX_INT_BITS + 1 + 6) // 7
# A length or count never needs more than 64 bits.
_MAX_LEN_BYTES = 10
_ALLOWED = "None, bool, int, float, str, bytes, list, tuple and dict (str or int keys)"


class _Refused(Exception):
    """An unsendable value; ``where`` collects the path to it on the way out."""

    def __init__(self, type_name: str, why: str, hint: str = "") -> None:
        super().__init__(why)
        self.type_name = type_name
        self.why = why
        self.hint = hint or (
            f"only {_ALLOWED} cross ranks; send a structured object as a tuple or dict "
            "(dataclasses.asdict) and rebuild it on the receiver")
        self.where: list[str] = []


def _varint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _put(out: bytearray, obj: Any, depth: int) -> None:
    kind = type(obj)
    if obj is None:
        out.append(_NONE)
    elif kind is bool:
        out.append(_TRUE if obj else _FALSE)
    elif kind is int:
        if obj.bit_length() > MAX_INT_BITS:
            raise _Refused("int", f"an int of {obj.bit_length()} bits",
                           f"ints of at most {MAX_INT_BITS} bits cross ranks; send a wider "
                           "one as its decimal str")
        out.append(_INT)
        _varint(out, obj << 1 if obj >= 0 else ((-obj) << 1) - 1)
    elif kind is float:
        out.append(_FLOAT)
        out += _DOUBLE.pack(obj)
    elif kind is str:
        data = obj.encode("utf-8", "surrogatepass")
        out.append(_STR)
        _varint(out, len(data))
        out += data
    elif kind is bytes or kind is bytearray or kind is memoryview:
        data = obj.tobytes() if kind is memoryview else obj
        out.append(_BYTES)
        _varint(out, len(data))
        out += data
    elif kind is list or kind is tuple or kind is dict:
        if depth >= MAX_DEPTH:
            raise _Refused(kind.__name__, f"nesting deeper than {MAX_DEPTH} levels",
                           "flatten the payload (a list that contains itself never ends)")
        out.append(_DICT if kind is dict else _LIST if kind is list else _TUPLE)
        _varint(out, len(obj))
        if kind is dict:
            _put_items(out, obj, depth + 1)
        else:
            for index, item in enumerate(obj):
                try:
                    _put(out, item, depth + 1)
                except _Refused as refused:
                    refused.where.append(f"[{index}]")
                    raise
    else:
        raise _Refused(_qualname(kind), f"a {_qualname(kind)}")


def _put_items(out: bytearray, obj: dict[Any, Any], depth: int) -> None:
    for key, value in obj.items():
        if type(key) is not str and type(key) is not int:
            raise _Refused(_qualname(type(key)), f"a dict key of type {_qualname(type(key))}")
        try:
            _put(out, key, depth)
            _put(out, value, depth)
        except _Refused as refused:
            refused.where.append(f"[{key!r}]")
            raise


def _qualname(kind: type) -> str:
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def encode(obj: Any) -> bytes:
    """``obj`` in the wire form; see the module doc for what it may hold.

    Raises:
        WireError: ``obj`` holds a value of another type (``type_name`` names it), an
            int wider than :data:`MAX_INT_BITS` bits, or nests deeper than
            :data:`MAX_DEPTH`.
    """
    out = bytearray(_HEADER)
    try:
        _put(out, obj, 0)
    except _Refused as refused:
        where = "".join(reversed(refused.where)) or "the payload itself"
        if len(where) > 120:
            where = where[:120] + "..."
        raise WireError(
            f"cannot send {refused.why} at {where}: {refused.hint}",
            op="encode", type_name=refused.type_name,
        ) from None
    return bytes(out)


class _Reader:
    """A cursor over one payload (a private ``bytes`` copy); every read checks the
    bytes left. Tags are tested most frequent first: this runs once per value."""

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.end = len(data)
        self.pos = pos

    def fail(self, why: str) -> WireError:
        return WireError(f"malformed payload at byte {self.pos}: {why}", op="decode")

    def varint(self, limit: int) -> int:
        data, pos = self.data, self.pos
        if pos < self.end and data[pos] < 0x80:  # most lengths and ints: one byte
            self.pos = pos + 1
            return data[pos]
        value = shift = 0
        for _ in range(limit):
            if pos >= self.end:
                self.pos = pos
                raise self.fail("it ends early")
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos = pos
                return value
            shift += 7
        self.pos = pos
        raise self.fail(f"a number longer than {limit} bytes")

    def take(self, count: int) -> bytes:
        pos = self.pos
        if count > self.end - pos:
            raise self.fail(f"{count} bytes announced, {self.end - pos} left")
        self.pos = pos + count
        return self.data[pos : pos + count]

    def value(self, depth: int) -> Any:
        pos = self.pos
        if pos >= self.end:
            raise self.fail("it ends early")
        tag = self.data[pos]
        self.pos = pos + 1
        if tag == _STR:
            raw = self.take(self.varint(_MAX_LEN_BYTES))
            try:
                return raw.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError as exc:
                raise self.fail(f"a string that is not UTF-8 ({exc.reason})") from None
        if tag == _INT:
            z = self.varint(_MAX_INT_BYTES)
            n = -((z + 1) >> 1) if z & 1 else z >> 1
            if n.bit_length() > MAX_INT_BITS:
                raise self.fail(f"an int of more than {MAX_INT_BITS} bits")
            return n
        if tag == _NONE:
            return None
        if tag in (_TUPLE, _LIST, _DICT):
            if depth >= MAX_DEPTH:
                raise self.fail(f"nesting deeper than {MAX_DEPTH} levels")
            n = self.varint(_MAX_LEN_BYTES)
            # Every item takes at least one byte: a count beyond the bytes left is forged.
            if n > self.end - self.pos:
                raise self.fail(f"{n} items announced, {self.end - self.pos} bytes left")
            if tag == _DICT:
                return self.items(n, depth + 1)
            value = self.value
            items = [value(depth + 1) for _ in range(n)]
            return tuple(items) if tag == _TUPLE else items
        if tag == _BYTES:
            return self.take(self.varint(_MAX_LEN_BYTES))
        if tag in (_FALSE, _TRUE):
            return tag == _TRUE
        if tag == _FLOAT:
            return _DOUBLE.unpack(self.take(8))[0]
        self.pos = pos
        raise self.fail(f"unknown tag 0x{tag:02x}")

    def items(self, n: int, depth: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for _ in range(n):
            at = self.pos
            key = self.value(depth)
            if type(key) is not str and type(key) is not int:
                self.pos = at
                raise self.fail(f"a dict key of type {type(key).__name__}")
            if key in out:
                self.pos = at
                raise self.fail(f"the dict key {key!r} twice")
            out[key] = self.value(depth)
        return out


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value :func:`encode` made ``data`` from.

    Raises:
        WireError: ``data`` is not a payload of this version: another format (a
            pickle, say), a newer version, truncated, forged or trailing bytes.
    """
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1 or not view.c_contiguous:
        view = memoryview(view.tobytes())  # any buffer, strided or not, as its bytes
    if len(view) == 0 or view[0] != MAGIC:
        head = bytes(view[:2]).hex(" ") or "nothing"
        hint = " (a pickle?)" if view[:1] == b"\x80" else ""
        raise WireError(
            f"not a distcache payload: it starts with {head}{hint}, expected 0x{MAGIC:02x}",
            op="decode",
        )
    if len(view) < 2:
        raise WireError("malformed payload: it ends before its version byte", op="decode")
    if view[1] != VERSION:
        raise WireError(
            f"payload format version {view[1]}, this distcache reads version {VERSION}; "
            "run the same distcache version on every rank",
            op="decode",
        )
    reader = _Reader(bytes(view), 2)
    value = reader.value(0)
    if reader.pos != reader.end:
        raise reader.fail(f"{reader.end - reader.pos} bytes after the value")
    return value


def decode_from(data: bytes | bytearray | memoryview, peer: int, where: str, *,
                rank: int, backend: str) -> Any:
    """:func:`decode` of the part rank ``peer`` all-gathered, received at ``where``
    (``"rank 1/4 (gpu017)"``) on ``rank`` of a ``backend`` communicator.

    Raises:
        WireError: the bytes are not a payload of this distcache (``peer`` names the
            sender).
    """
    try:
        return decode(data)
    except WireError as exc:
        raise WireError(
            f"allgather_object on {where}: the payload from rank {peer} was refused, and "
            f"nothing in it was run: {exc}. Check that every rank runs the same distcache "
            "and that only the job's own processes can reach its rendezvous store",
            op="allgather_object", rank=rank, backend=backend, peer=peer,
        ) from None


def _immutable(value: Any) -> bool:
    """Whether ``value`` (decoded plain data) can be handed to several ranks' entries."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return True
    return type(value) is tuple and all(_immutable(v) for v in value)


def decode_each(payloads: Iterable[tuple[Hashable, bytes | bytearray | memoryview]],
                where: str, *, rank: int, backend: str) -> list[Any]:
    """Every peer's value, in order, from ``(key, payload)`` pairs (one per peer; equal
    keys mean equal payloads). Each distinct payload is decoded once; an immutable
    value is shared by the peers that sent it, a mutable one decoded again for each,
    so that a caller may change one peer's entry without changing another's.

    Raises:
        WireError: a payload is not one (:func:`decode_from`).
    """
    out: list[Any] = []
    shared: dict[Hashable, Any] = {}
    for key, payload in payloads:
        if key in shared:
            out.append(shared[key])
            continue
        value = decode_from(payload, len(out), where, rank=rank, backend=backend)
        if _immutable(value):
            shared[key] = value
        out.append(value)
    return out
