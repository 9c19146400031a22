"""A process's view of a pool's ``names.log``: the ``name -> sha`` labels, read once
and then only what other processes appended since.

The log is appended to by any process and rewritten in place by ``pool rm`` and
``pool prune`` (which drop labels under its lock). A cached view must see both: each
read keeps the last record before the offset it reached, and the next read starts
over from the beginning where it changed (a rewrite moves the records), as well as
where the file became shorter than that offset. A lookup that would answer from the
cache alone first compares the log's size, change time and inode with those of the
last read (one ``stat``): a log changed since is read before anything is taken as
recorded, so a label that another process removed is recorded again.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from distcache.artifact import collapse_slashes
from distcache.errors import PoolError
from distcache.store._fs import READ_FLAGS, pool_error
from distcache.store._log import (
    _NAME_RECORD_MAX,
    AppendLog,
    _name_record,
    _parse_name_record,
    bounded_lines,
    not_a_log,
)

#: The most bytes before a read's end that the next read checks are still there: the
#: whole last record (its sha256 and checksum make it the only one of its kind), up to
#: this many bytes.
_TAIL = 4096
#: What the index fails with when something other than a regular file is at
#: ``names.log``: a symlink, a directory, a FIFO (:func:`~distcache.store._log.not_a_log`).
#: Whoever can write the pool can plant one; it costs labels, never a lookup by sha.
PLANTED_ERRNOS = frozenset({errno.ELOOP, errno.EISDIR, errno.EINVAL})

#: Why a pool this process reads cannot take a label: a read-only mount, another
#: user's pool, a full disk, a planted ``names.log``. A lookup that found its bytes
#: goes on without the label.
UNLABELLED_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC,
                               errno.EDQUOT}) | PLANTED_ERRNOS

#: What a ``stat`` of the log says of its content: inode, size, change time.
Seen = tuple[int, int, int]


def _seen(st: os.stat_result) -> Seen:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def read_checked(path: Path, offset: int, tail: bytes
                 ) -> tuple[list[str], int, bytes, bool, Seen | None]:
    """The complete records of the log at ``path`` after byte ``offset``; the offset
    after them; the bytes just before that offset (the next call's ``tail``); whether
    the read started over from the beginning (the log is shorter than ``offset``, or
    the bytes before it are no longer ``tail``: it was rewritten); and the log's
    :data:`Seen` (None: no log).

    The log is read a chunk at a time, and a line longer than any record (a
    zero-filled stretch a power loss left, a planted file) is skipped as it is read,
    never held whole: what is held is the records.

    Raises:
        PoolError: the log cannot be read, or is not a regular file (a symlink, a
            directory, a FIFO: :func:`~distcache.store._log.not_a_log`).
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return [], 0, b"", offset > 0, None
    except OSError as exc:
        raise (not_a_log("cannot read", path) or pool_error("cannot read", path, exc)) from exc
    try:
        st = os.fstat(fd)
        if (refused := not_a_log("cannot read", path, st.st_mode)) is not None:
            raise refused
        start = max(0, offset - len(tail))
        again = offset > st.st_size or os.pread(fd, offset - start, start) != tail
        if again:
            offset = 0
        records, end = _records(fd, offset, st.st_size)
        if end <= offset:  # nothing complete after the offset
            return [], offset, tail if not again else b"", again, _seen(st)
        # From the newline before the last record on: the record whole, not its last
        # bytes (names often share long endings: one kernel under two hash prefixes).
        lead = os.pread(fd, min(_TAIL, end - offset), end - min(_TAIL, end - offset))
        last = lead[max(lead.rfind(b"\n", 0, len(lead) - 1), 0):]
    except PoolError:
        raise
    except OSError as exc:
        raise pool_error("cannot read", path, exc) from exc
    finally:
        os.close(fd)
    return records, end, last, again, _seen(st)


def _records(fd: int, offset: int, size: int) -> tuple[list[str], int]:
    """The non-empty lines of the log open as ``fd`` between ``offset`` and the last
    newline before ``size`` that are not longer than any record, and the offset after
    that newline (``offset`` when there is none)."""
    records: list[str] = []
    end = offset
    for record, after in bounded_lines(fd, offset, size, _NAME_RECORD_MAX):
        end = after
        if record:
            records.append(record.decode("utf-8", "replace"))
    return records, end


class NamesIndex:
    """``name -> sha`` labels in an :class:`~distcache.store._log.AppendLog`; the
    last record for a name wins.

    The labels read so far are cached with the log offset they were read up to, so
    a refresh reads only what other processes appended since (the whole log again
    where it was rewritten, see the module).
    """

    def __init__(self, path: Path, mode: int) -> None:
        self._log = AppendLog(path, mode)
        self._guard = threading.Lock()
        self._names: dict[str, str] = {}
        self._offset, self._tail = 0, b""
        self._seen: Seen | None = None  # of the log at the last refresh
        # The last record line per name, unparsed, and where it was read up to
        # (refreshed_holds before the first parse).
        self._raw: dict[str, str] = {}
        self._raw_offset, self._raw_tail = 0, b""

    def holds(self, pairs: Iterable[tuple[str, str]]) -> bool:
        """Whether every ``(name, sha)`` is already the label this process read or
        wrote last, and the log is unchanged since (one ``stat``, no read)."""
        try:
            now: Seen | None = _seen(os.stat(self._log.path))
        except OSError:
            now = None
        with self._guard:
            return now is not None and now == self._seen and self._cached(pairs)

    def _cached(self, pairs: Iterable[tuple[str, str]]) -> bool:
        try:
            return all(self._names.get(name) == sha for name, sha in pairs)
        except TypeError:  # an unhashable (forged) name is held by no one
            return False

    def refreshed_holds(self, pairs: Iterable[tuple[str, str]]) -> bool:
        """Whether every ``(name, sha)`` is the label in the log, read up to its end
        (a process that has not read the log yet learns it here, once).

        A process that has not read the log first compares it as text: when the last
        record of each name is exactly the record ``pairs`` would write (so its
        checksum holds), nothing is parsed or validated. A warm start that confirms a
        whole family's labels costs a split per record, not a parse.

        Raises:
            PoolError: the log cannot be read.
        """
        pairs = list(pairs)
        with self._guard:
            unread = self._offset == 0
        if unread and self._log_holds(pairs):
            return True
        self._refresh()
        with self._guard:
            return self._cached(pairs)

    def _log_holds(self, pairs: list[tuple[str, str]]) -> bool:
        """Whether the log's last record for each name is the one ``pairs`` give it
        (text compared; a damaged later record makes this False, and the caller
        parses). The last record line per name is kept with the offset it was read
        up to, so a later call reads only what was appended since."""
        with self._guard:
            records, self._raw_offset, self._raw_tail, again, _ = read_checked(
                self._log.path, self._raw_offset, self._raw_tail)
            if again:
                self._raw.clear()
            for line in records:
                parts = line.split(" ", 2)
                if len(parts) == 3:  # keyed as the parse would name it
                    self._raw[collapse_slashes(parts[2])] = line
            try:
                for name, sha in pairs:
                    # Exactly the record this pair would append ("<sha> <crc> <name>").
                    if self._raw.get(name) != _name_record(name, sha):
                        return False
            except (TypeError, AttributeError, ValueError):  # a forged pair: held by no one
                return False
        return True

    def record(self, wanted: Iterable[tuple[str, str]]) -> None:
        """Append a record for each already validated ``(name, sha)`` whose label
        differs from the current one (callers skip what :meth:`holds` already).

        Raises:
            PoolError: the log cannot be read or written.
        """
        current = self._refresh()
        new = [_name_record(name, sha) for name, sha in dict(wanted).items()
               if current.get(name) != sha]
        if new:
            self._log.append(new)
            self._refresh()

    def snapshot(self) -> dict[str, str]:
        """A copy of every label, read up to the end of the log.

        Raises:
            PoolError: the log cannot be read.
        """
        return dict(self._refresh())

    def _refresh(self) -> dict[str, str]:
        with self._guard:
            records, self._offset, self._tail, again, self._seen = read_checked(
                self._log.path, self._offset, self._tail)
            if again:
                self._names.clear()
            for line in records:
                parsed = _parse_name_record(line)
                if parsed is not None:
                    self._names[parsed[0]] = parsed[1]
            return self._names
