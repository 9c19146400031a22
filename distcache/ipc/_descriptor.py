"""The wire form of :class:`PoolDescriptor`: everything a consumer needs to map one
producer pool, as a few hundred bytes that travel over any channel (the registry's
all-gather, or the engine's own ZMQ socket or pipe for a producer outside the
consumers' communicator). Decoding treats its input as hostile (:mod:`._wire`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from distcache.errors import IpcError
from distcache.ipc._layout import ALIGNMENT, Layout
from distcache.ipc._wire import (
    BACKENDS,
    MAX_BYTES,
    MAX_RANK,
    bad,
    check_int,
    check_pool_id,
    decode,
)

_THING = "pool descriptor"  # what a malformed one is called in its error


def _bad(what: str, pool_id: str | None = None) -> IpcError:
    return bad(what, pool_id, _THING)


_DESC_MAGIC = b"DCP"
#: Version 2: the segment carries audience words per slot and a consumer table.
#: Version 3: and the extent (offset, bytes) of each slot's lease.
DESCRIPTOR_VERSION = 3
_DESC_HEAD = struct.Struct("<3sBBB")  # magic, version, backend code, pool_id length
# owner, epoch, capacity, data_start, slots, ack_words, device, n_consumers, handle len,
# node id len
_DESC_BODY = struct.Struct("<IQQQIHhHHB")
#: ``owner`` on the wire when the producer is not a rank of the consumers' group.
_NO_OWNER = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class PoolDescriptor:
    """Everything a consumer needs to map one producer pool.

    ``handle`` is backend-specific and opaque here (a segment name for ``shm``, an
    exported CUDA IPC handle for ``cuda``). ``consumers`` are the ranks that ack; a
    consumer's index is its position in that tuple. ``owner`` is the producer's rank
    in the consumers' communicator, or None when the producer is not one of its ranks.
    """

    pool_id: str
    backend: str
    owner: int | None
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
        if self.owner is not None:
            check_int("owner", self.owner, _NO_OWNER - 1, pid, _THING)
        check_int("epoch", self.epoch, (1 << 63) - 1, pid, _THING)
        check_int("capacity", self.capacity, MAX_BYTES, pid, _THING)
        check_int("data_start", self.data_start, MAX_BYTES, pid, _THING)
        check_int("slots", self.slots, 1 << 20, pid, _THING)
        check_int("ack_words", self.ack_words, 0xFFFF, pid, _THING)
        if type(self.device) is not int or not -1 <= self.device <= 0x7FFF:
            raise _bad(f"device={self.device!r} must be -1 (host) or a device index", pid)
        if self.slots == 0 or Layout(self.slots, self.ack_words).words * 4 > self.data_start:
            raise _bad("control words overlap the data region", pid)
        if self.data_start % ALIGNMENT:
            raise _bad(f"data_start={self.data_start} is not aligned to {ALIGNMENT} bytes", pid)
        if not isinstance(self.consumers, tuple) or len(self.consumers) > self.ack_words:
            raise _bad(f"{self.consumers!r} consumers exceed {self.ack_words} ack words", pid)
        for rank in self.consumers:
            check_int("consumer rank", rank, MAX_RANK, pid, _THING)
        if len(set(self.consumers)) != len(self.consumers):
            raise _bad(f"consumer ranks {list(self.consumers)} repeat a rank", pid)
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
                    _NO_OWNER if self.owner is None else self.owner,
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
        if not isinstance(data, bytes | bytearray | memoryview):
            raise _bad(f"expected bytes for a pool descriptor, got {type(data).__name__}")
        return decode(cls._unpack, data, "pool descriptor")

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
            owner=None if owner == _NO_OWNER else owner,
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


def gathered_descriptors(gathered: list[list[bytes]]) -> list[PoolDescriptor]:
    """Decode an all-gathered round (rank -> its packed descriptors), checking that
    each pool is claimed by one rank only, the rank that owns it.

    Raises:
        IpcError: a rank sent something other than a list of descriptors, garbled
            bytes (naming the rank), or a pool id claimed twice or by a non-owner.
    """
    seen: dict[str, int] = {}
    descriptors = []
    for rank, packed in enumerate(gathered):
        if type(packed) is not list:
            raise IpcError(f"rank {rank} sent {packed!r:.120}, not a list of pool "
                           "descriptors")
        for blob in packed:
            try:
                desc = PoolDescriptor.unpack(blob)
            except IpcError as exc:
                raise IpcError(f"rank {rank} sent a malformed pool descriptor: {exc}",
                               pool_id=getattr(exc, "pool_id", None)) from None
            if desc.owner != rank:
                raise IpcError(f"rank {rank} sent pool {desc.pool_id} of rank {desc.owner}: a "
                               "rank shares only its own pools", pool_id=desc.pool_id)
            if seen.setdefault(desc.pool_id, rank) != rank:
                raise IpcError(
                    f"pool id {desc.pool_id} is claimed by ranks {seen[desc.pool_id]} and {rank}",
                    pool_id=desc.pool_id,
                )
            descriptors.append(desc)
    return descriptors
