"""Where the last collective sync over a set of pools left each pool's logs: an offset
into ``journal.log`` (``sync.cursor``) and one into ``names.log``
(``sync.names.cursor``), each with its check on the log, so the next sync over the
same pools sends only what follows (see :mod:`distcache.store.layout`).

Both files hold ``<pools key> <byte offset> <mark>`` lines and are read and written
alike: opened never through a link and never blocking (one that is not a regular file
holds no cursor), edited under a lock in ``locks/`` (two jobs sharing a pool keep their
cursors at once) and replaced whole by a fresh exclusive temporary file renamed into
place. A line whose key is not of the form :func:`pools_key` gives (or ``-``) is
dropped: it is damage, and no sync reads it. A cursor whose mark its log no longer
matches is not resumed from: that log is sent whole.

A line ends with the token of the sync that kept it, one drawn per sync and kept in
every pool of its set (``<pools key> <byte offset> <mark> <token>``): a cursor says
what reached the pools of that sync, and a pool copied or restored under the same id
carries another sync's token, or none (see :mod:`distcache.collective._trust`). A
``sync.names.cursor`` line is resumed from only with the token of the pool's
``sync.cursor`` line: the two are kept one after the other, and a label cursor left
behind would send what that sync delivered as news.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from pathlib import Path

from distcache._log import get_logger
from distcache.errors import PoolError
from distcache.store import Pool
from distcache.store._fs import CREATE_FLAGS, READ_FLAGS, is_hex, process_umask, write_all
from distcache.store._locking import FileLock
from distcache.store._log import journal_mark, names_since

log = get_logger(__name__)

#: The most a cursor file is read of, and the most cursors it keeps (the latest).
_CURSOR_BYTES = 4096
_MAX_CURSORS = 32
#: The length of a :func:`pools_key` and of a sync's token, in hex digits.
KEY_LENGTH = TOKEN_LENGTH = 16
#: The key of a cursor kept for no set of pools (a caller's own).
PLAIN_KEY = "-"
#: How long keeping a cursor waits for another process editing the same file; past
#: that the cursor is not kept (logged), as for any other failure to keep it.
_LOCK_SECONDS = 5.0

#: A cursor line as read: its offset, its mark, and the token of the sync that kept
#: it (None: a line without one, an older one).
Line = tuple[int, str, str | None]


def pools_key(pool_ids: list[str]) -> str:
    """The key of the cursor a sync over ``pool_ids`` keeps: what one job's sync sent
    says nothing of what a sync over other pools (another job sharing a pool) did."""
    joined = "\n".join(sorted(set(pool_ids)))
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()[:KEY_LENGTH]


def is_key(key: str) -> bool:
    """Whether ``key`` is one a cursor is kept under: a :func:`pools_key` or ``-``."""
    return key == PLAIN_KEY or is_hex(key, KEY_LENGTH)


def stored_cursor(pool: Pool, key: str = PLAIN_KEY) -> int:
    """The journal offset the last sync over ``pool`` with ``key`` (:func:`pools_key`)
    reached (0: none, a pool that keeps no files, or a cursor whose mark the journal no
    longer matches)."""
    return held_cursor(pool, key)[0]


def held_cursor(pool: Pool, key: str) -> tuple[int, str | None]:
    """:func:`stored_cursor` with the token of the sync that kept it (None where the
    pool keeps none for ``key``: then the offset is 0 as well)."""
    path = _layout_path(pool, "sync_cursor")
    if path is None:
        return 0, None
    cursor, mark, token = _read_cursors(path).get(key, (0, None, None))
    if mark is None or not journal_matches(pool, cursor, mark):
        return 0, token
    return cursor, token


def store_cursor(pool: Pool, cursor: int, mark: str | None = None, key: str = PLAIN_KEY,
                 token: str | None = None) -> None:
    """Keep the journal ``cursor`` for ``key`` in ``pool`` with its ``mark`` (taken now
    when not given) and the ``token`` of the sync that reached it, beside the latest
    cursors of other keys; a failure is logged: the next sync then sends more than it
    must, and nothing is lost."""
    path = _layout_path(pool, "sync_cursor")
    journal = journal_path(pool)
    if path is None or journal is None:
        return
    mark = journal_mark(journal, cursor) if mark is None else mark
    if mark is None:
        log.warning("sync: the journal of %s no longer reaches %d; no cursor kept",
                    path.parent, cursor)
        return
    _keep(pool, path, key, (cursor, mark, token), "journal")


def journal_matches(pool: Pool, cursor: int, mark: str | None) -> bool:
    """Whether ``pool``'s journal still holds what ``cursor`` was taken after (a pool
    without files is taken at its word; a cursor kept without a mark, where there is a
    journal, is not)."""
    journal = journal_path(pool)
    if journal is None:
        return True
    return mark is not None and journal_mark(journal, cursor) == mark


def journal_past_received(pool: Pool, cursor: int, mark: str | None,
                          everywhere: set[str]) -> tuple[int, str | None]:
    """``cursor`` moved past what the journal gained during the sync when all of it
    is in ``everywhere`` (what the sync left in every pool: the objects it received),
    so the next sync does not list them again; else ``cursor`` as it was."""
    try:
        gained, end = pool.journal_since(cursor)
    except Exception:  # the journal is read again by the next sync
        return cursor, mark
    if end <= cursor or not everywhere.issuperset(gained):
        return cursor, mark
    journal = journal_path(pool)
    if journal is None:
        return end, None
    later = journal_mark(journal, end)
    return (end, later) if later is not None else (cursor, mark)


def journal_path(pool: Pool) -> Path | None:
    return _layout_path(pool, "journal_log")


def labels_since(pool: Pool, key: str,
                 held: tuple[int, str] | None = None, *, whole: bool = False,
                 token: str | None = None
                 ) -> tuple[dict[str, str], int, str, bool] | None:
    """The labels ``pool``'s ``names.log`` recorded after the cursor the pool keeps for
    ``key``, or after ``held`` (a session's) when that is further and still valid; all
    of them when neither is, or with ``whole``. The pool's cursor is resumed from only
    where it was kept with ``token`` (the journal cursor's): one left behind by a sync
    that kept the journal's (its keeping failed, or stopped between the two) would send
    labels that sync delivered as news, to revert a label recorded since. With the
    offset read up to, its mark, and whether a cursor held (False: the whole log); None
    for a pool that keeps no files.

    Raises:
        PoolError: the log cannot be read.
    """
    names = _layout_path(pool, "names_log")
    if names is None:
        return None
    path = _layout_path(pool, "sync_names_cursor")
    starts: list[tuple[int, str]] = []
    if path is not None and not whole:
        line = _read_cursors(path).get(key)
        if line is not None and token is not None and line[2] == token:
            starts.append((line[0], line[1]))
        else:
            starts.append((0, ""))
    if held is not None:
        starts.append(held)
    return names_since(names, starts)


def store_labels_cursor(pool: Pool, cursor: int, mark: str, key: str,
                        token: str | None = None) -> None:
    """Keep the ``names.log`` ``cursor`` for ``key`` in ``pool`` with its ``mark`` and
    the ``token`` of the sync that reached it, as :func:`store_cursor` keeps the
    journal's."""
    path = _layout_path(pool, "sync_names_cursor")
    if path is not None:
        _keep(pool, path, key, (cursor, mark, token), "label")


def labels_past_received(pool: Pool, cursor: int, mark: str,
                         everywhere: dict[str, str]) -> tuple[int, str]:
    """``cursor`` moved past the labels ``names.log`` gained during the sync when each
    is the one ``everywhere`` holds (the labels the sync recorded in this pool), so the
    next sync does not send them back; else ``cursor`` as it was."""
    names = _layout_path(pool, "names_log")
    if names is None:
        return cursor, mark
    try:
        gained, end, later, _ = names_since(names, [(cursor, mark)], verify=False)
    except Exception:  # the log is read again by the next sync
        return cursor, mark
    if end <= cursor or any(everywhere.get(n) != s for n, s in gained.items()):
        return cursor, mark
    return end, later


def _keep(pool: Pool, path: Path, key: str, line: Line, what: str) -> None:
    """Write ``line`` for ``key`` into the cursor file at ``path``, beside the latest
    cursors of other keys, to a fresh exclusive temporary file renamed into place,
    holding the file's lock in ``locks/`` while it reads, edits and renames (a process
    keeping another key's cursor meanwhile would otherwise drop one of the two); a
    failure, a wait for the lock past :data:`_LOCK_SECONDS` included, is logged."""
    if not is_key(key):
        log.warning("sync: no %s cursor kept in %s under %r: not a key a sync reads",
                    what, path, key)
        return
    locks = _layout_path(pool, "locks")
    lock = None if locks is None else FileLock(locks / f"{path.name}.lock",
                                               timeout=_LOCK_SECONDS)
    try:
        if lock is not None and not lock.acquire():
            log.warning("sync: no %s cursor kept in %s: another process held its lock "
                        "for %.0f s", what, path, _LOCK_SECONDS)
            return
        try:
            _replace(path, key, line)
        finally:
            if lock is not None:
                lock.release()
    except (OSError, PoolError, ValueError) as exc:  # UnicodeError is a ValueError
        log.warning("sync: cannot keep the %s cursor in %s: %s", what, path, exc)


def _replace(path: Path, key: str, line: Line) -> None:
    """The edit :func:`_keep` makes, under its lock.

    Raises:
        OSError: the file cannot be written.
        ValueError: a line cannot be written as ASCII.
    """
    cursors = _read_cursors(path)
    cursors.pop(key, None)
    cursors[key] = line
    text = "".join(f"{k} {c} {m}" + ("" if t is None else f" {t}") + "\n"
                   for k, (c, m, t) in list(cursors.items())[-_MAX_CURSORS:])
    data = text.encode("ascii")
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    try:
        fd = os.open(temp, CREATE_FLAGS, 0o600)
        try:
            os.fchmod(fd, 0o666 & ~process_umask())
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def _read_cursors(path: Path) -> dict[str, Line]:
    """The well-formed ``<key> <offset> <mark> [<token>]`` lines of the cursor file,
    oldest first (none when it is absent, not a regular file, or unreadable). A line
    under a key no sync writes (:func:`is_key`: damage, or another tool's) is dropped,
    and logged once per read."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        text = os.read(fd, _CURSOR_BYTES).decode("ascii", "replace")
    except OSError:
        return {}
    finally:
        os.close(fd)
    cursors: dict[str, Line] = {}
    dropped = 0
    for row in text.split("\n"):
        parts = row.split(" ")
        token = parts[3] if len(parts) == 4 and is_hex(parts[3], TOKEN_LENGTH) else None
        if (len(parts) in (3, 4) and (len(parts) == 3 or token is not None)
                and is_key(parts[0]) and parts[1].isascii() and parts[1].isdigit()
                and len(parts[1]) <= 20 and is_hex(parts[2], 8)):
            cursors.pop(parts[0], None)
            cursors[parts[0]] = (int(parts[1]), parts[2], token)
        elif row:
            dropped += 1
    if dropped:
        log.debug("sync: %d malformed line(s) in %s dropped", dropped, path)
    return cursors


def _layout_path(pool: Pool, name: str) -> Path | None:
    """The path ``name`` of ``pool``'s layout (None: a pool that keeps no files)."""
    path = getattr(getattr(pool, "layout", None), name, None)
    return path if isinstance(path, Path) else None
