"""The wire form of :class:`FeatureRef`: one feature in a pool, as a few dozen bytes.

Pickle-free, versioned, built with :mod:`struct`. Decoding treats its input as
hostile: every length, count and value is checked, and anything malformed raises
:class:`~distcache.errors.IpcError` (never ``struct.error``, ``UnicodeDecodeError`` or
``MemoryError``). Validation lives in ``__post_init__``, so a ref built by hand is held
to the same rules as one decoded from bytes. The pool's descriptor is in
:mod:`distcache.ipc._descriptor`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from distcache.ipc._descriptor import PoolDescriptor
from distcache.ipc._wire import (
    DTYPE_CODES,
    DTYPES,
    MAX_BYTES,
    MAX_GENERATION,
    MAX_NDIM,
    bad,
    check_int,
    check_pool_id,
    decode,
    itemsize,
)

_REF_MAGIC = b"DCR"
_REF_VERSION = 1
_REF_HEAD = struct.Struct("<3sBBB")  # magic, version, flags, pool_id length
_REF_BODY = struct.Struct("<QQQIIBB")  # epoch, offset, nbytes, slot, generation, dtype, ndim
_FLAG_DESCRIPTOR = 0x01


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
        check_int("epoch", self.epoch, (1 << 63) - 1, pid)
        check_int("offset", self.offset, MAX_BYTES, pid)
        check_int("nbytes", self.nbytes, MAX_BYTES, pid)
        check_int("slot", self.slot, 0xFFFFFFFF, pid)
        check_int("generation", self.generation, MAX_GENERATION, pid)
        if self.generation == 0:
            raise bad("generation 0 is never issued", pid)
        size = itemsize(self.dtype)
        if not isinstance(self.shape, tuple) or not isinstance(self.strides, tuple):
            raise bad("shape and strides must be tuples", pid)
        if len(self.shape) > MAX_NDIM or len(self.strides) != len(self.shape):
            raise bad(
                f"ndim {len(self.shape)} (strides {len(self.strides)}) exceeds {MAX_NDIM} "
                "or differs between shape and strides",
                pid,
            )
        numel, extent = 1, 0
        for dim, stride in zip(self.shape, self.strides, strict=True):
            check_int("shape entry", dim, MAX_BYTES, pid)
            check_int("stride", stride, MAX_BYTES, pid)
            numel *= dim
            if numel > MAX_BYTES:
                raise bad(f"shape {self.shape} is too large", pid)
            extent += (dim - 1) * stride if dim else 0
        if numel * size != self.nbytes:
            raise bad(
                f"shape {self.shape} x {self.dtype} ({size} B) is {numel * size} bytes, "
                f"but nbytes={self.nbytes}",
                pid,
            )
        if numel and (extent + 1) * size > self.nbytes:
            raise bad(f"strides {self.strides} reach past nbytes={self.nbytes}", pid)
        if self.descriptor is not None:
            if not isinstance(self.descriptor, PoolDescriptor):
                raise bad("descriptor must be a PoolDescriptor", pid)
            if (self.descriptor.pool_id, self.descriptor.epoch) != (self.pool_id, self.epoch):
                raise bad("carried descriptor names another pool or epoch", pid)

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
                DTYPE_CODES[self.dtype],
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
            raise bad(f"expected bytes, got {type(data).__name__}")
        return decode(cls._unpack, data, "feature reference")

    @classmethod
    def _unpack(cls, buf: memoryview) -> FeatureRef:
        magic, version, flags, id_len = _REF_HEAD.unpack_from(buf, 0)
        if magic != _REF_MAGIC:
            raise bad("not a feature reference (bad magic)")
        if version != _REF_VERSION:
            raise bad(f"feature reference version {version} is not supported (want 1)")
        if flags & ~_FLAG_DESCRIPTOR:
            raise bad(f"unknown flags {flags:#x}")
        pos = _REF_HEAD.size
        pool_id = bytes(buf[pos : pos + id_len]).decode("ascii")
        pos += id_len
        epoch, offset, nbytes, slot, generation, code, ndim = _REF_BODY.unpack_from(buf, pos)
        pos += _REF_BODY.size
        if code not in DTYPES:
            raise bad(f"unknown dtype code {code}", pool_id)
        if ndim > MAX_NDIM:
            raise bad(f"ndim {ndim} exceeds {MAX_NDIM}", pool_id)
        dims = struct.unpack_from(f"<{2 * ndim}Q", buf, pos)
        pos += 16 * ndim
        descriptor = None
        if flags & _FLAG_DESCRIPTOR:
            (d_len,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if pos + d_len != len(buf):
                raise bad("descriptor length does not match the remaining bytes", pool_id)
            descriptor = PoolDescriptor.unpack(bytes(buf[pos:]))
        elif pos != len(buf):
            raise bad(f"{len(buf) - pos} trailing bytes", pool_id)
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
