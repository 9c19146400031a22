"""Where the last collective sync over a set of pools left each pool's logs: an offset
into ``journal.log`` (``sync.cursor``) and one into ``names.log``
(``sync.names.cursor``), each with its check on the log, so the next sync over the
same pools sends only what follows (see :mod:`distcache.store.layout`).

Both files hold ``<pools key> <byte offset> <mark>`` lines and are read and written
alike: opened never through a link and never blocking (one that is not a regular file
holds no cursor), replaced whole by a fresh exclusive temporary file renamed into
place. A cursor whose mark its log no longer matches is not resumed from: that log is
sent whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from pathlib import Path

from distcache._log import get_logger
from distcache.store import Pool
from distcache.store._fs import CREATE_FLAGS, READ_FLAGS, is_hex, process_umask, write_all
from distcache.store._log import journal_mark, names_since

log = get_logger(__name__)

#: The most a cursor file is read of, and the most cursors it keeps (the latest).
_CURSOR_BYTES = 4096
_MAX_CURSORS = 32


def pools_key(pool_ids: list[str]) -> str:
    """The key of the cursor a sync over ``pool_ids`` keeps: what one job's sync sent
    says nothing of what a sync over other pools (another job sharing a pool) did."""
    joined = "\n".join(sorted(set(pool_ids)))
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()[:16]


def stored_cursor(pool: Pool, key: str = "-") -> int:
    """The journal offset the last sync over ``pool`` with ``key`` (:func:`pools_key`)
    reached (0: none, a pool that keeps no files, or a cursor whose mark the journal no
    longer matches)."""
    path = _layout_path(pool, "sync_cursor")
    if path is None:
        return 0
    cursor, mark = _read_cursors(path).get(key, (0, None))
    return cursor if mark is not None and journal_matches(pool, cursor, mark) else 0


def store_cursor(pool: Pool, cursor: int, mark: str | None = None, key: str = "-") -> None:
    """Keep the journal ``cursor`` for ``key`` in ``pool`` with its ``mark`` (taken now
    when not given), beside the latest cursors of other keys; a failure is logged: the
    next sync then sends more than it must, and nothing is lost."""
    path = _layout_path(pool, "sync_cursor")
    journal = journal_path(pool)
    if path is None or journal is None:
        return
    mark = journal_mark(journal, cursor) if mark is None else mark
    if mark is None:
        log.warning("sync: the journal of %s no longer reaches %d; no cursor kept",
                    path.parent, cursor)
        return
    _keep(path, key, cursor, mark, "journal")


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
                 held: tuple[int, str] | None = None
                 ) -> tuple[dict[str, str], int, str, bool] | None:
    """The labels ``pool``'s ``names.log`` recorded after the cursor the pool keeps for
    ``key``, or after ``held`` (a session's) when that is further and still valid; all
    of them when neither is. With the offset read up to, its mark, and whether a cursor
    held (False: the whole log); None for a pool that keeps no files.

    Raises:
        PoolError: the log cannot be read.
    """
    names = _layout_path(pool, "names_log")
    if names is None:
        return None
    path = _layout_path(pool, "sync_names_cursor")
    starts = [] if path is None else [_read_cursors(path).get(key, (0, ""))]
    if held is not None:
        starts.append(held)
    return names_since(names, starts)


def store_labels_cursor(pool: Pool, cursor: int, mark: str, key: str) -> None:
    """Keep the ``names.log`` ``cursor`` for ``key`` in ``pool`` with its ``mark``, as
    :func:`store_cursor` keeps the journal's."""
    path = _layout_path(pool, "sync_names_cursor")
    if path is not None:
        _keep(path, key, cursor, mark, "label")


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


def _keep(path: Path, key: str, cursor: int, mark: str, what: str) -> None:
    """Write ``cursor`` and ``mark`` for ``key`` into the cursor file at ``path``,
    beside the latest cursors of other keys, to a fresh exclusive temporary file
    renamed into place; a failure is logged."""
    cursors = _read_cursors(path)
    cursors.pop(key, None)
    cursors[key] = (cursor, mark)
    text = "".join(f"{k} {c} {m}\n" for k, (c, m) in list(cursors.items())[-_MAX_CURSORS:])
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    try:
        fd = os.open(temp, CREATE_FLAGS, 0o600)
        try:
            os.fchmod(fd, 0o666 & ~process_umask())
            write_all(fd, text.encode("ascii"))
        finally:
            os.close(fd)
        os.replace(temp, path)
    except OSError as exc:
        log.warning("sync: cannot keep the %s cursor in %s: %s", what, path, exc)
        with contextlib.suppress(OSError):
            temp.unlink()


def _read_cursors(path: Path) -> dict[str, tuple[int, str]]:
    """The well-formed ``<key> <offset> <mark>`` lines of the cursor file, oldest
    first (none when it is absent, not a regular file, or unreadable)."""
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
    cursors: dict[str, tuple[int, str]] = {}
    for line in text.split("\n"):
        parts = line.split(" ")
        if (len(parts) == 3 and parts[1].isascii() and parts[1].isdigit()
                and len(parts[1]) <= 20 and is_hex(parts[2], 8)):
            cursors.pop(parts[0], None)
            cursors[parts[0]] = (int(parts[1]), parts[2])
    return cursors


def _layout_path(pool: Pool, name: str) -> Path | None:
    """The path ``name`` of ``pool``'s layout (None: a pool that keeps no files)."""
    path = getattr(getattr(pool, "layout", None), name, None)
    return path if isinstance(path, Path) else None
