"""Wire formats: :class:`FeatureRef` (one feature in a pool) and :class:`PoolDescriptor`
(how to map a pool).

Both travel between processes, so both have a pickle-free, versioned binary form built
with :mod:`struct`. Decoding treats its input as hostile: every length, count and
value is checked, and anything malformed raises :class:`~distcache.errors.IpcError`
(never ``struct.error``, ``UnicodeDecodeError`` or ``MemoryError``). Validation lives
in ``__post_init__``, so a ref built by hand is held to the same rules as one decoded
from bytes.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
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
_DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}
_ITEMSIZE = dict(DTYPES.values())

MAX_NDIM = 16
#: Upper bound on any size or offset (256 TiB): keeps products far from overflow
#: surprises and rejects absurd forged values early.
MAX_BYTES = 1 << 48
MAX_GENERATION = 0x7FFFFFFF
# \Z, not $: "$" also matches before a trailing newline ("pool\n" would pass).
_POOL_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")

BACKENDS = ("shm", "cuda")

_REF_MAGIC = b"DCR"
_REF_VERSION = 1
_REF_HEAD = struct.Struct("<3sBBB")  # magic, version, flags, pool_id length
_REF_BODY = struct.Struct("<QQQIIBB")  # epoch, offset, nbytes, slot, generation, dtype, ndim
_FLAG_DESCRIPTOR = 0x01

_DESC_MAGIC = b"DCP"
DESCRIPTOR_VERSION = 1
_DESC_HEAD = struct.Struct("<3sBBB")  # magic, version, backend code, pool_id length
# owner, epoch, capacity, data_start, slots, ack_words, device, n_consumers, handle len,
# node id len
_DESC_BODY = struct.Struct("<IQQQIHhHHB")


def _bad(what: str, pool_id: str | None = None) -> IpcError:
    return IpcError(f"invalid feature reference: {what}", pool_id=pool_id)


_T = TypeVar("_T")


def _decode(
    parse: Callable[[memoryview], _T], data: bytes | bytearray | memoryview, what: str
) -> _T:
    """Run ``parse`` over a private copy of ``data``; any decoding failure of forged or
    garbled bytes becomes an :class:`IpcError`, never another exception."""
    try:
        return parse(memoryview(bytes(data)))
    except IpcError:
        raise
    except (struct.error, ValueError, TypeError, UnicodeDecodeError, IndexError) as exc:
        raise _bad(f"garbled {what} ({exc})") from None


def _check_int(name: str, value: Any, upper: int, pool_id: str | None) -> None:
    if type(value) is not int or not 0 <= value <= upper:
        raise _bad(f"{name}={value!r} must be an integer in [0, {upper}]", pool_id)


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


@dataclass(frozen=True, slots=True)
class PoolDescriptor:
    """Everything a consumer needs to map one producer pool.

    ``handle`` is backend-specific and opaque here (a segment name for ``shm``, an
    exported CUDA IPC handle for ``cuda``). ``consumers`` are the ranks that ack; a
    consumer's index is its position in that tuple.
    """

    pool_id: str
    backend: str
    owner: int
    node_id: str
    epoch: int
    capacity: int
    data_start: int
    slots: int
    ack_words: int
    device: int
    consumers: tuple[int, ...]
    handle: bytes
    version: int = DESCRIPTOR_VERSION

    def __post_init__(self) -> None:
        check_pool_id(self.pool_id)
        pid = self.pool_id
        if self.backend not in BACKENDS:
            raise _bad(f"backend {self.backend!r} is not one of {BACKENDS}", pid)
        if self.version != DESCRIPTOR_VERSION:
            raise _bad(f"descriptor version {self.version!r} != {DESCRIPTOR_VERSION}", pid)
        _check_int("owner", self.owner, 0xFFFFFFFF, pid)
        _check_int("epoch", self.epoch, (1 << 63) - 1, pid)
        _check_int("capacity", self.capacity, MAX_BYTES, pid)
        _check_int("data_start", self.data_start, MAX_BYTES, pid)
        _check_int("slots", self.slots, 1 << 20, pid)
        _check_int("ack_words", self.ack_words, 0xFFFF, pid)
        if type(self.device) is not int or not -1 <= self.device <= 0x7FFF:
            raise _bad(f"device={self.device!r} must be -1 (host) or a device index", pid)
        if (1 + self.ack_words) * 4 * self.slots > self.data_start:
            raise _bad("control words overlap the data region", pid)
        if not isinstance(self.consumers, tuple) or len(self.consumers) > self.ack_words:
            raise _bad(f"{self.consumers!r} consumers exceed {self.ack_words} ack words", pid)
        for rank in self.consumers:
            _check_int("consumer rank", rank, 0xFFFFFFFF, pid)
        if not isinstance(self.handle, bytes) or not 0 < len(self.handle) <= 0xFFFF:
            raise _bad("handle must be 1-65535 bytes", pid)
        if not isinstance(self.node_id, str) or len(self.node_id.encode()) > 255:
            raise _bad("node_id must be a string of at most 255 bytes", pid)

    @property
    def segment_bytes(self) -> int:
        """Size of the whole shared segment: control words plus data."""
        return self.data_start + self.capacity

    def pack(self) -> bytes:
        """The versioned binary form. Inverse of :meth:`unpack`."""
        pid = self.pool_id.encode()
        node = self.node_id.encode()
        return b"".join(
            [
                _DESC_HEAD.pack(_DESC_MAGIC, self.version, BACKENDS.index(self.backend), len(pid)),
                pid,
                _DESC_BODY.pack(
                    self.owner,
                    self.epoch,
                    self.capacity,
                    self.data_start,
                    self.slots,
                    self.ack_words,
                    self.device,
                    len(self.consumers),
                    len(self.handle),
                    len(node),
                ),
                struct.pack(f"<{len(self.consumers)}I", *self.consumers),
                self.handle,
                node,
            ]
        )

    @classmethod
    def unpack(cls, data: bytes) -> PoolDescriptor:
        """Decode and validate :meth:`pack` output.

        Raises:
            IpcError: the bytes are not a valid descriptor of a supported version.
        """
        return _decode(cls._unpack, data, "pool descriptor")

    @classmethod
    def _unpack(cls, buf: memoryview) -> PoolDescriptor:
        magic, version, backend, id_len = _DESC_HEAD.unpack_from(buf, 0)
        if magic != _DESC_MAGIC:
            raise _bad("not a pool descriptor (bad magic)")
        if version != DESCRIPTOR_VERSION:
            raise _bad(f"pool descriptor version {version} is not supported")
        if backend >= len(BACKENDS):
            raise _bad(f"unknown backend code {backend}")
        pos = _DESC_HEAD.size
        pool_id = bytes(buf[pos : pos + id_len]).decode("ascii")
        pos += id_len
        body = _DESC_BODY.unpack_from(buf, pos)
        pos += _DESC_BODY.size
        owner, epoch, capacity, data_start, slots, ack_words, device, n_cons, h_len, n_len = body
        need = pos + 4 * n_cons + h_len + n_len
        if len(buf) != need:
            raise _bad(f"pool descriptor is {len(buf)} bytes, its fields say {need}")
        consumers = struct.unpack_from(f"<{n_cons}I", buf, pos)
        pos += 4 * n_cons
        handle = bytes(buf[pos : pos + h_len])
        node_id = bytes(buf[pos + h_len : need]).decode("utf-8")
        return cls(
            pool_id=pool_id,
            backend=BACKENDS[backend],
            owner=owner,
            node_id=node_id,
            epoch=epoch,
            capacity=capacity,
            data_start=data_start,
            slots=slots,
            ack_words=ack_words,
            device=device,
            consumers=tuple(consumers),
            handle=handle,
            version=version,
        )


@dataclass(frozen=True, slots=True)
class FeatureRef:
    """One feature leased in a producer pool: a small, pickle-free descriptor.

    ``strides`` are in elements (torch's convention). ``nbytes`` is exactly
    ``numel * itemsize`` and every element the strides reach lies inside it.
    ``descriptor`` optionally carries the pool's :class:`PoolDescriptor`, so a
    consumer can map a restarted producer's new epoch (invalidate-and-retry).
    """

    pool_id: str
    epoch: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    slot: int
    generation: int
    descriptor: PoolDescriptor | None = None

    def __post_init__(self) -> None:
        check_pool_id(self.pool_id)
        pid = self.pool_id
        _check_int("epoch", self.epoch, (1 << 63) - 1, pid)
        _check_int("offset", self.offset, MAX_BYTES, pid)
        _check_int("nbytes", self.nbytes, MAX_BYTES, pid)
        _check_int("slot", self.slot, 0xFFFFFFFF, pid)
        _check_int("generation", self.generation, MAX_GENERATION, pid)
        if self.generation == 0:
            raise _bad("generation 0 is never issued", pid)
        size = itemsize(self.dtype)
        if not isinstance(self.shape, tuple) or not isinstance(self.strides, tuple):
            raise _bad("shape and strides must be tuples", pid)
        if len(self.shape) > MAX_NDIM or len(self.strides) != len(self.shape):
            raise _bad(
                f"ndim {len(self.shape)} (strides {len(self.strides)}) exceeds {MAX_NDIM} "
                "or differs between shape and strides",
                pid,
            )
        numel, extent = 1, 0
        for dim, stride in zip(self.shape, self.strides, strict=True):
            _check_int("shape entry", dim, MAX_BYTES, pid)
            _check_int("stride", stride, MAX_BYTES, pid)
            numel *= dim
            if numel > MAX_BYTES:
                raise _bad(f"shape {self.shape} is too large", pid)
            extent += (dim - 1) * stride if dim else 0
        if numel * size != self.nbytes:
            raise _bad(
                f"shape {self.shape} x {self.dtype} ({size} B) is {numel * size} bytes, "
                f"but nbytes={self.nbytes}",
                pid,
            )
        if numel and (extent + 1) * size > self.nbytes:
            raise _bad(f"strides {self.strides} reach past nbytes={self.nbytes}", pid)
        if self.descriptor is not None:
            if not isinstance(self.descriptor, PoolDescriptor):
                raise _bad("descriptor must be a PoolDescriptor", pid)
            if (self.descriptor.pool_id, self.descriptor.epoch) != (self.pool_id, self.epoch):
                raise _bad("carried descriptor names another pool or epoch", pid)

    def without_descriptor(self) -> FeatureRef:
        """The same ref, minus its carried descriptor (smaller on the wire)."""
        return FeatureRef(
            self.pool_id, self.epoch, self.offset, self.nbytes, self.dtype,
            self.shape, self.strides, self.slot, self.generation,
        )  # fmt: skip

    def pack(self) -> bytes:
        """The compact binary form (magic, version, fields). Inverse of :meth:`unpack`."""
        pid = self.pool_id.encode()
        ndim = len(self.shape)
        parts = [
            _REF_HEAD.pack(
                _REF_MAGIC,
                _REF_VERSION,
                _FLAG_DESCRIPTOR if self.descriptor is not None else 0,
                len(pid),
            ),
            pid,
            _REF_BODY.pack(
                self.epoch,
                self.offset,
                self.nbytes,
                self.slot,
                self.generation,
                _DTYPE_CODES[self.dtype],
                ndim,
            ),
            struct.pack(f"<{ndim}Q{ndim}Q", *self.shape, *self.strides),
        ]
        if self.descriptor is not None:
            packed = self.descriptor.pack()
            parts += [struct.pack("<I", len(packed)), packed]
        return b"".join(parts)

    @classmethod
    def unpack(cls, data: bytes) -> FeatureRef:
        """Decode and validate :meth:`pack` output.

        Raises:
            IpcError: the bytes are truncated, padded, of another version, or name an
                unknown dtype, too many dimensions, negative or inconsistent sizes.
        """
        if not isinstance(data, bytes | bytearray | memoryview):
            raise _bad(f"expected bytes, got {type(data).__name__}")
        return _decode(cls._unpack, data, "feature reference")

    @classmethod
    def _unpack(cls, buf: memoryview) -> FeatureRef:
        magic, version, flags, id_len = _REF_HEAD.unpack_from(buf, 0)
        if magic != _REF_MAGIC:
            raise _bad("not a feature reference (bad magic)")
        if version != _REF_VERSION:
            raise _bad(f"feature reference version {version} is not supported (want 1)")
        if flags & ~_FLAG_DESCRIPTOR:
            raise _bad(f"unknown flags {flags:#x}")
        pos = _REF_HEAD.size
        pool_id = bytes(buf[pos : pos + id_len]).decode("ascii")
        pos += id_len
        epoch, offset, nbytes, slot, generation, code, ndim = _REF_BODY.unpack_from(buf, pos)
        pos += _REF_BODY.size
        if code not in DTYPES:
            raise _bad(f"unknown dtype code {code}", pool_id)
        if ndim > MAX_NDIM:
            raise _bad(f"ndim {ndim} exceeds {MAX_NDIM}", pool_id)
        dims = struct.unpack_from(f"<{2 * ndim}Q", buf, pos)
        pos += 16 * ndim
        descriptor = None
        if flags & _FLAG_DESCRIPTOR:
            (d_len,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if pos + d_len != len(buf):
                raise _bad("descriptor length does not match the remaining bytes", pool_id)
            descriptor = PoolDescriptor.unpack(bytes(buf[pos:]))
        elif pos != len(buf):
            raise _bad(f"{len(buf) - pos} trailing bytes", pool_id)
        return cls(
            pool_id=pool_id,
            epoch=epoch,
            offset=offset,
            nbytes=nbytes,
            dtype=DTYPES[code][0],
            shape=tuple(dims[:ndim]),
            strides=tuple(dims[ndim:]),
            slot=slot,
            generation=generation,
            descriptor=descriptor,
        )
