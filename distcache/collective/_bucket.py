"""Buckets: the messages a move is made of (:mod:`distcache.collective._stream`).

A *bucket* is one broadcast message holding several artifacts. Its layout puts the
table *after* the payloads, so the sender can append each artifact into one growing
buffer and finish with the table, never copying the payloads a second time::

    payload_0 | payload_1 | ... | table: count x (index u32, length i64) | trailer

    trailer = magic b"DCB1", flags u8 (bit 0: last bucket of this stream), count u32

A length of -1 marks an artifact the source could not read (the source reports the
failure; the stream goes on, so every rank keeps calling the same broadcasts).
Chunking of messages over 2 GiB is the communicator's job. :class:`StreamStats`
records what one rank's streams cost, the peak of what they held included.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable, Iterator

from distcache.errors import WireError

MAGIC = b"DCB1"
_ENTRY = struct.Struct("<Iq")
_TRAILER = struct.Struct("<4sBI")
_LAST = 1

#: An item index that is no artifact: the bucket built so far travels now, even empty
#: (a source whose next artifact is still downloading keeps its turns going).
PAUSE = -1


class StreamStats:
    """What one rank's streams cost (summed over streams)."""

    def __init__(self) -> None:
        #: Bucket messages this rank broadcast as the root.
        self.broadcasts = 0
        #: Bytes of those messages (payloads and tables).
        self.bytes_sent = 0
        #: Largest number of bytes this rank held at once for a transfer: as a source,
        #: the bucket in flight, the one being built and the artifact that did not
        #: fit; as a receiver, the buckets arrived and not yet published (the larger).
        self.peak_bytes = 0
        #: Objects this rank published into its pool from received buckets.
        self.published = 0
        #: Payload bytes this rank received (as a writer, from other writers' streams).
        self.received_bytes = 0
        #: Of those, bytes of objects its pool already held, thrown away.
        self.discarded_bytes = 0
        # The read-ahead thread and the protocol's thread both record what they hold.
        self._guard = threading.Lock()

    def hold(self, nbytes: int) -> None:
        with self._guard:
            self.peak_bytes = max(self.peak_bytes, nbytes)


def encode_bucket(items: Iterable[tuple[int, bytes | None]], *, last: bool) -> bytearray:
    """Pack ``(index, payload or None)`` pairs into one bucket message."""
    body = bytearray()
    table: list[tuple[int, int]] = []
    for index, data in items:
        _append(body, table, index, data)
    return _finish(body, table, last)


def _append(
    body: bytearray, table: list[tuple[int, int]], index: int, data: bytes | None
) -> None:
    if data is None:
        table.append((index, -1))
    else:
        body += data
        table.append((index, len(data)))


def _finish(body: bytearray, table: list[tuple[int, int]], last: bool) -> bytearray:
    for index, length in table:
        body += _ENTRY.pack(index, length)
    body += _TRAILER.pack(MAGIC, _LAST if last else 0, len(table))
    return body


def decode_bucket(message: bytes | bytearray, objects: int | None = None,
                  ) -> tuple[bool, list[tuple[int, memoryview | None]]]:
    """Unpack a bucket: ``(last, [(index, payload view or None), ...])``; with
    ``objects``, every index must be below it (a peer's bucket names only the plan's
    objects).

    Raises:
        WireError: the message is not a well-formed bucket (a ``ValueError``).
    """
    view = memoryview(message)
    last, count = _trailer(view)
    table_start = len(view) - _TRAILER.size - count * _ENTRY.size
    entries: list[tuple[int, memoryview | None]] = []
    offset = 0
    for k in range(count):
        index, length = _ENTRY.unpack_from(view, table_start + k * _ENTRY.size)
        if objects is not None and index >= objects:
            raise WireError(f"bucket entry {k} names object {index} of {objects}", op="decode")
        if length < -1:
            raise WireError(f"bucket entry {k} has length {length}", op="decode")
        if length == -1:
            entries.append((index, None))
            continue
        if offset + length > table_start:
            raise WireError(f"bucket entry {k} overruns the payload area", op="decode")
        entries.append((index, view[offset : offset + length]))
        offset += length
    if offset != table_start:
        raise WireError(f"bucket payload area has {table_start - offset} unclaimed bytes",
                        op="decode")
    return last, entries


def bucket_last(message: bytes | bytearray) -> bool:
    """Whether ``message`` is the last bucket of its stream, read from its trailer
    alone (a bucket whose table is malformed still says where its stream ends).

    Raises:
        WireError: the trailer itself cannot be read.
    """
    return _trailer(memoryview(message))[0]


def _trailer(view: memoryview) -> tuple[bool, int]:
    """The trailer's ``(last, count)``, its table within the message."""
    if len(view) < _TRAILER.size:
        raise WireError(f"bucket of {len(view)} bytes is shorter than its trailer", op="decode")
    magic, flags, count = _TRAILER.unpack_from(view, len(view) - _TRAILER.size)
    if magic != MAGIC or len(view) - _TRAILER.size - count * _ENTRY.size < 0:
        raise WireError("bucket trailer is corrupt (bad magic or count)", op="decode")
    return bool(flags & _LAST), count


def bucket_messages(
    items: Iterable[tuple[int, bytes | None]], *, bucket_bytes: int, stats: StreamStats
) -> Iterator[bytearray]:
    """The bucket messages of ``items``, of about ``bucket_bytes`` each, the last one
    flagged (at least one, possibly empty, so receivers stay in step).

    ``items`` is consumed lazily (a generator reading from the pool keeps memory at
    the bucket being built and one artifact, beside the message yielded before while
    it travels). An artifact larger than ``bucket_bytes`` travels alone; an item of
    index :data:`PAUSE` seals the bucket built so far (maybe empty). Each payload is
    copied once, into the message being built, which the broadcast then sends in place.
    """
    body = bytearray()
    table: list[tuple[int, int]] = []
    sealed = 0  # the message yielded last, which may still be in flight
    for index, data in items:
        if index == PAUSE:
            message = _sealed(body, table, stats, last=False)
            sealed = len(message)
            yield message
            del message
            body, table = bytearray(), []
            continue
        size = 0 if data is None else len(data)
        stats.hold(sealed + len(body) + size)
        if table and len(body) + size > bucket_bytes:
            message = _sealed(body, table, stats, last=False)
            sealed = len(message)
            yield message
            del message
            body, table = bytearray(), []
        _append(body, table, index, data)
        del data
    yield _sealed(body, table, stats, last=True)


def _sealed(body: bytearray, table: list[tuple[int, int]], stats: StreamStats, *,
            last: bool) -> bytearray:
    message = _finish(body, table, last)
    stats.broadcasts += 1
    stats.bytes_sent += len(message)
    return message
