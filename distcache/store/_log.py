"""The pool's append-only logs: ``names.log`` (name -> sha labels) and ``journal.log``
(shas published into the pool).

Both are files of newline-framed records that any number of processes append to and
read without coordination beyond a briefly held ``flock``. A crashed writer can leave
a torn last line; the framing confines the damage to that record, readers consume
complete lines only, and name records carry a CRC so a torn or damaged label is
skipped rather than misread. They live apart from :mod:`distcache.store._pool` because the
store's correctness never depends on them: they label and list objects, they do not
hold them.

Files are opened, written and their failures reported the way the rest of the pool
does it, with the pieces of :mod:`distcache.store._fs`.
"""

from __future__ import annotations

import errno
import os
import stat
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import MAX_NAME_BYTES, validate_name
from distcache.errors import PoolError
from distcache.store._fs import APPEND_FLAGS, READ_FLAGS, is_sha, pool_error, write_all
from distcache.store._locking import flock_fd

_APPEND_LOCK_WAIT = 5.0

logger = get_logger(__name__)
#: How much of the journal is read at a time, and the length of one record.
_CHUNK = 1 << 16
_RECORD = 64
#: The longest names record: a sha, its crc32 in hex and the longest name, spaced.
_NAME_RECORD_MAX = 64 + 1 + 8 + 1 + MAX_NAME_BYTES


class AppendLog:
    """An append-only file of newline-framed records.

    Each append is one ``O_APPEND`` write of ``"\\n<record>\\n"`` under a briefly
    held ``flock`` (O_APPEND alone is not atomic across NFS clients). The leading
    newline isolates the torn tail a crashed writer may have left, so a torn record
    costs that record only; readers consume complete lines only. A lock another
    process holds past ``_APPEND_LOCK_WAIT`` seconds (a stopped process, a long
    ``pool rm``) is not waited for further: the records are appended without it, with
    a warning, since a record the logs lose only costs a later lookup or sync, and a
    failed append would fail the publication it records. The log is opened without
    blocking and only a regular file is written: a FIFO, a directory or a symlink at
    its path is refused (:func:`not_a_log`), never waited on or written through.
    """

    def __init__(self, path: Path, mode: int) -> None:
        self.path = path
        self.mode = mode

    def append(self, records: Iterable[str]) -> None:
        """Append ``records``, each framed by newlines.

        Raises:
            PoolError: the log cannot be opened or written, or is not a regular file.
        """
        data = "".join(f"\n{r}\n" for r in records).encode("utf-8")
        if not data:
            return
        try:  # a FIFO no one reads fails here (ENXIO) rather than waiting for a reader
            fd = os.open(self.path, APPEND_FLAGS, self.mode)
        except OSError as exc:
            raise (not_a_log("cannot open", self.path)
                   or pool_error("cannot open", self.path, exc)) from exc
        try:
            refused = not_a_log("cannot append to", self.path, os.fstat(fd).st_mode)
            if refused is not None:
                raise refused
            os.set_blocking(fd, True)  # a regular file: written as any other
            if flock_fd(fd, _APPEND_LOCK_WAIT, path=str(self.path)) is False:
                logger.warning("%s: another process has held its lock for more than %gs; "
                               "appending without it", self.path, _APPEND_LOCK_WAIT)
            write_all(fd, data)
        except PoolError:
            raise
        except OSError as exc:
            raise pool_error("cannot append to", self.path, exc) from exc
        finally:
            os.close(fd)


#: What ``lstat`` may find at a log's path instead of a regular file, and the errno
#: that says so: a symlink, a directory, else (a FIFO, a socket, a device) EINVAL.
_NOT_A_FILE = ((stat.S_ISLNK, "a symbolic link", errno.ELOOP),
               (stat.S_ISDIR, "a directory", errno.EISDIR),
               (stat.S_ISFIFO, "a FIFO", errno.EINVAL))


def not_a_log(what: str, path: Path, mode: int | None = None) -> PoolError | None:
    """The error of a log at ``path`` that is not a regular file (its ``mode``, else
    what ``lstat`` finds there): ``what`` failed, what is there instead, and that
    removing it lets the pool start a new log. None when it is a regular file, or
    nothing can be said of it (absent, or ``lstat`` fails)."""
    if mode is None:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return None
    if stat.S_ISREG(mode):
        return None
    kind, code = next(((kind, code) for test, kind, code in _NOT_A_FILE if test(mode)),
                      ("a socket or device", errno.EINVAL))
    return PoolError(f"{what} {path}: not a regular file but {kind}; remove it to let the "
                     "pool start a new log", path=str(path), errno=code)


def _name_crc(sha: str, name: str) -> str:
    return f"{zlib.crc32(f'{sha} {name}'.encode()):08x}"


def _name_record(name: str, sha: str) -> str:
    return f"{sha} {_name_crc(sha, name)} {name}"


def _parse_name_record(line: str) -> tuple[str, str] | None:
    parts = line.split(" ", 2)
    if len(parts) != 3 or not is_sha(parts[0]):
        return None
    sha, crc, name = parts
    if _name_crc(sha, name) != crc:
        return None  # torn or damaged
    try:
        return validate_name(name), sha
    except ValueError:
        return None


class Journal:
    """The shas published into a pool, one per record, in publication order."""

    def __init__(self, path: Path, mode: int) -> None:
        self._log = AppendLog(path, mode)

    def append(self, sha: str) -> None:
        """Record that ``sha`` was published.

        Raises:
            PoolError: the journal cannot be written.
        """
        self._log.append([sha])

    def since(self, cursor: int = 0) -> tuple[list[str], int]:
        """Shas recorded after ``cursor``, oldest first and without repeats (torn or
        foreign lines are skipped), and the cursor to pass next time. A cursor past the
        end (the journal was replaced) restarts from the beginning. The journal is read
        a chunk at a time: what is held is the distinct shas, not the file.

        Raises:
            PoolError: the journal cannot be read.
        """
        path = self._log.path
        try:
            fd = os.open(path, READ_FLAGS)
        except FileNotFoundError:
            return [], 0
        except OSError as exc:  # a symlink there: said as such
            raise (not_a_log("cannot read", path) or pool_error("cannot read", path, exc)) from exc
        seen: dict[str, None] = {}
        try:
            size = os.fstat(fd).st_size
            end = start = 0 if cursor > size else cursor
            for record, after in bounded_lines(fd, start, size, _RECORD):
                end = after
                if len(record) == _RECORD:
                    text = record.decode("ascii", "replace")
                    if is_sha(text):
                        seen[text] = None
        except OSError as exc:
            raise pool_error("cannot read", path, exc) from exc
        finally:
            os.close(fd)
        return list(seen), end


def bounded_lines(fd: int, offset: int, size: int, longest: int
                  ) -> Iterator[tuple[bytes, int]]:
    """The complete lines of the file open as ``fd`` between ``offset`` and the last
    newline before ``size``, without their newline, each with the offset after it;
    read a chunk at a time, and a line longer than ``longest`` bytes (a zero-filled
    stretch a power loss left, a planted file) is skipped as it is read, never held
    whole.

    Raises:
        OSError: the file cannot be read.
    """
    pos = offset
    line: bytes | None = b""  # the line so far; None: too long to be a record
    while pos < size:
        data = os.pread(fd, min(_CHUNK, size - pos), pos)
        if not data:
            return
        pieces = data.split(b"\n")
        at = pos
        for piece in pieces[:-1]:
            at += len(piece) + 1
            if line is not None and len(line) + len(piece) <= longest:
                yield line + piece, at
            else:  # over-long: skipped, though its end still counts as read
                yield b"", at
            line = b""
        line = None if line is None or len(line) + len(pieces[-1]) > longest else (
            line + pieces[-1])
        pos += len(data)


#: How many journal bytes before a cursor its mark covers (about two records).
_MARK_BYTES = 128


def journal_mark(path: Path, offset: int) -> str | None:
    """A check on the journal at ``path`` up to ``offset``: the crc32 of the bytes just
    before it, as 8 hex digits (``offset`` 0: the crc32 of nothing). None when the
    journal is shorter than ``offset``, or cannot be read. A cursor kept with its mark
    is only resumed from where the journal still holds those bytes, so a journal
    removed, replaced or restored from elsewhere is read from its beginning instead
    of from an offset into other records.
    """
    if offset < 0:
        return None
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return None if offset else f"{zlib.crc32(b''):08x}"
    try:
        if offset > os.fstat(fd).st_size:
            return None
        start = max(0, offset - _MARK_BYTES)
        data = os.pread(fd, offset - start, start)
    except OSError:
        return None
    finally:
        os.close(fd)
    return f"{zlib.crc32(data):08x}" if len(data) == offset - start else None


def names_since(path: Path, starts: Iterable[tuple[int, str]], *,
                verify: bool = True) -> tuple[dict[str, str], int, str, bool]:
    """The labels ``names.log`` at ``path`` records after the furthest of ``starts``
    (``(offset, mark)`` pairs) whose mark still holds, else all of them, the last record
    of a name winning; the offset after the last complete record, its mark, and whether
    a start held (False: the whole log was read; a start at 0 holds when its mark is
    that of no bytes, ``00000000``).

    A mark here is the crc32 of every byte before its offset, as 8 hex digits. The log
    is rewritten in place by ``pool prune`` (labels dropped, a relabelled name written
    where it first appeared) and may keep its length and its last records, so a check
    on the bytes just before an offset (the journal's) would not notice. ``verify``
    False takes a single start at its word (a cursor taken during the same sync); a
    wrong one then only yields a mark that the next read does not match. The log is
    read a chunk at a time; one that is absent or not a regular file holds no labels.

    Raises:
        PoolError: the log cannot be read.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return {}, 0, f"{0:08x}", (0, f"{0:08x}") in set(starts)
    except OSError as exc:
        raise pool_error("cannot read", path, exc) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return {}, 0, f"{0:08x}", False
        start, crc, held = _valid_start(fd, st.st_size, sorted(set(starts)), verify)
        return (*_labels_from(fd, st.st_size, start, crc), held)
    except OSError as exc:
        raise pool_error("cannot read", path, exc) from exc
    finally:
        os.close(fd)


def _valid_start(fd: int, size: int, starts: list[tuple[int, str]],
                 verify: bool) -> tuple[int, int, bool]:
    """The furthest of ``starts`` (sorted) whose mark is the crc32 of the bytes before
    it, that crc32, and True; ``(0, 0, False)`` when none is."""
    if not verify:
        offset, mark = starts[0] if len(starts) == 1 else (0, "")
        return (offset, int(mark, 16), True) if 0 < offset <= size else (0, 0, False)
    found = (0, 0, False)
    crc = pos = 0
    for offset, mark in starts:
        if offset > size:
            break
        while pos < offset:
            data = os.pread(fd, min(_CHUNK, offset - pos), pos)
            if not data:
                return found
            crc = zlib.crc32(data, crc)
            pos += len(data)
        if pos == offset and f"{crc:08x}" == mark:
            found = (offset, crc, True)
    return found


def _labels_from(fd: int, size: int, start: int, crc: int) -> tuple[dict[str, str], int, str]:
    """The labels of the complete records from ``start`` (``crc`` the crc32 of the
    bytes before it), the offset after them and its mark. A line longer than any
    record (a zero-filled tail a power loss left, a planted file) is skipped as it is
    read, never held whole."""
    labels: dict[str, str] = {}
    pos = end = start
    running = crc  # of every byte before ``pos``; ``crc``: of those before ``end``
    line: bytes | None = b""  # the record so far; None: too long to be one
    while pos < size:
        data = os.pread(fd, min(_CHUNK, size - pos), pos)
        if not data:
            break
        pieces = data.split(b"\n")
        for piece in pieces[:-1]:
            record = None if line is None else line + piece
            parsed = _parse_name_record(record.decode("utf-8", "replace")) if record else None
            if parsed is not None:
                labels[parsed[0]] = parsed[1]
            line = b""
        if len(pieces) > 1:
            cut = data.rfind(b"\n") + 1
            end, crc = pos + cut, zlib.crc32(data[:cut], running)
        running = zlib.crc32(data, running)
        line = None if line is None else line + pieces[-1]
        if line is not None and len(line) > _NAME_RECORD_MAX:
            line = None
        pos += len(data)
    return labels, end, f"{crc:08x}"
