"""Directories in and out of the pool: scan a cache directory into tree entries,
publish its files, and materialise a tree into a directory.

A file is published as a whole or not at all: one whose ``stat`` moves while it is
read is left out, and a publication stores a file that changed just before only once
it has been left alone for :data:`SETTLE_NS` (:func:`settle`): tools such as ninja,
nvcc and linkers write their outputs in place, and a copy taken mid-write would be
placed, truncated, on every node that lacks the file. Only ``stat`` tells: a writer
that stops for longer than that in the middle of a file is not told from one that
has finished.

Materialising only adds files. A file already at a path is never replaced (a running
compile may be reading it, or is about to replace it itself); a missing one is written
to a temporary name in its own directory, then linked into place, which fails rather
than replaces if another writer got there first. Every byte comes from a verified
pool read. The directory, and every directory on the way to a file, must belong to
this process's user and be a real directory (not a symbolic link): code in another
user's directory is not this user's to fill. The directories above it, and any
symbolic link on the way to it, must belong to this user or to root, and none may be
one that every user can change (:func:`~distcache.jit._walk.check_way`). A file that
cannot be written (a name this filesystem refuses) is counted as missing and logged;
the others are placed.

Entries that carry a modification time (a family that keeps times: FlashInfer's JIT,
whose ninja rebuilds an output older than its inputs) get it back when they are
written, so that a directory filled from the pool is as up to date as the one that
was published; a time in the future is clamped to the time of placing (a clock, or a
tree, ahead of this node's never makes a file look newer than what is built here
later), and a file already in place keeps its own. Hard-linked files (``link``) keep
the pool object's time: the object is shared.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import validate_name
from distcache.errors import ArtifactNameError, PoolError
from distcache.jit._stream import store_fd
from distcache.jit._tree import MODE_MASK, TreeEntry
from distcache.jit._walk import (
    FOREIGN,
    NO_LINKS,
    WHOLE_FS,
    InTheWay,
    LinkRefused,
    Refused,
    Uncreatable,
    check_way,
    ensure_dirs,
    walk,
    whole_filesystem,
)
from distcache.store import ArtifactPool
from distcache.store._fs import Witness, witness
from distcache.store._fs import hash_fd as _read_all  # a hook tests wrap
from distcache.store.layout import STALE_TMP_SECONDS

log = get_logger(__name__)


@dataclass
class Placed:
    """What one materialisation did."""

    #: Files written.
    written: int = 0
    #: Files already there, of the tree's size.
    present: int = 0
    #: Files already there of another size, or not regular files (kept as they are).
    kept: int = 0
    #: Files whose object no pool holds, or that could not be written (logged).
    missing: int = 0
    #: Bytes written.
    bytes: int = 0


#: A file changed this close (ns) to the scan that hashed it may change again within
#: the same tick of the filesystem's clock (a second on some filesystems) without
#: its times moving: it is hashed again at the next scan.
RACY_NS = 2 * 10**9
#: How long (ns) a file changed just before a publication must be left alone before
#: it is stored: a tool writing a file moves its times far more often than this.
SETTLE_NS = 250 * 10**6

#: path -> (:data:`~distcache.store._fs.Witness`, sha256) of a file hashed before:
#: what a later scan of the same directory in the same process need not read again.
#: The witness (device, inode, size, modification and change times) moves with a
#: rewrite even where the tool keeps the modification time (the change time moves),
#: and with a new file renamed into place (another inode); a read moves none of it.
Seen = dict[str, tuple[Witness, str]]


def settled(st: os.stat_result) -> bool:
    """Whether the file last changed well before now (:data:`RACY_NS`), so that a
    later rewrite moves its witness."""
    return max(st.st_mtime_ns, st.st_ctime_ns) < time.time_ns() - RACY_NS


@dataclass(frozen=True)
class Fresh:
    """A file that changed within :data:`RACY_NS` of its scan: read but not stored,
    since the tool may still be writing it (ninja, nvcc and linkers write their
    outputs in place). :func:`settle` reads it again once it has been left alone."""

    #: What the scan read (its bytes may be partial).
    entry: TreeEntry
    rel: str
    path: Path
    prefix: str
    witness: Witness
    #: Its last change (ns): modification or change time, the later.
    changed_ns: int


def scan_into(pool: ArtifactPool, root: Path, prefix: str = "",
              known: dict[str, TreeEntry] | None = None,
              seen: Seen | None = None, *, times: bool = False,
              fresh: list[Fresh] | None = None) -> list[TreeEntry]:
    """Store every file under ``root`` in ``pool`` and return its entries (paths
    under ``prefix``; with ``times``, each with its modification time). A file
    ``known`` lists with the digest it still has is not stored again, and one
    ``seen`` records with its current witness is not read again (``seen`` is
    updated; a file changed just before is not recorded). With ``fresh``, a file
    changed just before (:func:`settled`) is neither stored nor returned but added
    to ``fresh``, for :func:`settle`. A file whose ``stat`` moves while it is read
    (a tool writing it), files vanishing mid-scan and names that are not safe
    artifact paths are skipped."""
    entries: list[TreeEntry] = []
    with pool.batch():  # one flush for the whole directory, not one per file
        for rel, path in walk(root):
            entry = _scan_one(pool, rel, path, prefix, known, seen, times, fresh)
            if entry is not None:
                entries.append(entry)
    return entries


def settle(pool: ArtifactPool, fresh: Sequence[Fresh],
           known: dict[str, TreeEntry] | None = None, *,
           times: bool = False) -> list[TreeEntry]:
    """Wait until the files of ``fresh`` last changed :data:`SETTLE_NS` ago (at most
    that long: a time ahead of this node's clock waits no longer), then read each
    again and store it, as :func:`scan_into` does; the entries of the files that no
    tool touched meanwhile (same ``stat`` as at the scan, unmoved while read). A
    file still changing is left out, for the next publication.

    Waiting is what lets a publication right after a build (at a sync, or at exit,
    where no later one comes) store what the build just finished, while a file that
    a tool is still writing moves within the window and is left out."""
    if not fresh:
        return []
    now = time.time_ns()
    until = min(max(f.changed_ns for f in fresh) + SETTLE_NS, now + SETTLE_NS)
    if until > now:
        time.sleep((until - now) / 1e9)
    entries: list[TreeEntry] = []
    with pool.batch():
        for f in fresh:
            # Not recorded in ``seen``: read again at the next scan, as any file
            # changed close to its scan.
            entry = _scan_one(pool, f.rel, f.path, f.prefix, known, None, times, None,
                              expect=f.witness)
            if entry is not None:
                entries.append(entry)
    return entries


def _scan_one(pool: ArtifactPool, rel: str, path: Path, prefix: str,
              known: dict[str, TreeEntry] | None, seen: Seen | None,
              times: bool, fresh: list[Fresh] | None,
              expect: Witness | None = None) -> TreeEntry | None:
    """Store one file and return its entry; ``None`` for an unsafe name, a file that
    vanished or is not regular, one whose ``stat`` moved while it was read or is not
    ``expect``, and one changed just before when ``fresh`` collects those."""
    try:
        name = validate_name(f"{prefix}{rel}")
        # Non-blocking: a FIFO put where the scan saw a file must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (ArtifactNameError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (expect is not None and witness(st) != expect):
            return None
        if st.st_uid != os.geteuid():
            # Not built by a rank of the job: another user's code stays out of the pool.
            log.warning("%s belongs to uid %d, not to this user (uid %d): left out of the "
                        "pool", path, st.st_uid, os.geteuid())
            return None
        mode = st.st_mode & MODE_MASK
        mtime = st.st_mtime_ns if times else None
        before = known.get(name) if known else None
        last = seen.get(name) if seen is not None else None
        if (last is not None and last[0] == witness(st)
                and before is not None and before.sha256 == last[1]):
            return TreeEntry(name, last[1], mode, st.st_size, mtime)
        sha, size = _read_all(fd, st.st_size)  # hashed a piece at a time
        # A writer that moved the file while it was read: what was read may be
        # neither the old bytes nor the new ones.
        if size != st.st_size or witness(os.fstat(fd)) != witness(st):
            if seen is not None:
                seen.pop(name, None)
            return None
        entry = TreeEntry(name, sha, mode, size, mtime)
        quiet = settled(st)
        if fresh is not None and not quiet:
            fresh.append(Fresh(entry, rel, path, prefix, witness(st),
                               max(st.st_mtime_ns, st.st_ctime_ns)))
            if seen is not None:
                seen.pop(name, None)
            return None
        # Copied from the same descriptor, checked against ``sha`` on the way: a file
        # rewritten since it was hashed is not stored (nor listed).
        if (before is None or before.sha256 != sha or not pool.has(sha)) and (
                not store_fd(pool, fd, sha, size) or witness(os.fstat(fd)) != witness(st)):
            if seen is not None:
                seen.pop(name, None)
            return None
    except OSError as exc:
        if isinstance(exc, PoolError):
            raise
        return None
    finally:
        os.close(fd)
    if seen is not None:
        if quiet:
            seen[name] = (witness(st), sha)
        else:
            seen.pop(name, None)
    return entry


def materialize_entries(pool: ArtifactPool, root: Path, entries: Sequence[TreeEntry], *,
                        family: str, prefix: str = "", link: bool = False) -> Placed:
    """Write the entries under ``prefix`` that ``root`` lacks (with ``prefix``
    stripped), never replacing a file. ``link`` hard-links the pool's object instead
    of copying it (same filesystem only; the file then has the object's read-only
    mode, and a tool that writes in place would write into the pool, so copying is
    the default).

    A file where the tree has a directory keeps its place, as does a directory below
    ``root`` that is another user's or a symbolic link (with a warning): the entries
    under it are counted as ``kept``, the others written; those under a directory
    that cannot be created are ``missing`` (one warning). Entries under a :data:`FOREIGN`
    directory (listed by trees published before it was left out) are skipped. A
    written copy gets the entry's time, if it has one, clamped to now. A file that
    cannot be written is counted as ``missing`` and logged, and the others placed,
    unless the filesystem as a whole refuses (:data:`WHOLE_FS`: full, read-only, or
    without the hard links that placing a file without replacing one needs).

    Raises:
        JitCacheError: ``root`` or a directory on the way to it belongs to another
            user or is a symbolic link, or cannot be created
            (:func:`~distcache.jit._walk.check_way`); :class:`~distcache.jit._walk.WholeFilesystem`
            (an OSError too, with its errno) naming the family and the file when the
            filesystem is read-only or full, or has no hard links.
        PoolError: an object cannot be read.
    """
    check_way(root, family=family, create=True)
    placed = Placed()
    checked: set[Path] = {root}
    swept: set[Path] = set()
    refused: set[str] = set()
    now = time.time_ns()  # one bound for the whole call keeps the files' order
    for entry in entries:
        if not entry.path.startswith(prefix):
            continue
        rel = entry.path[len(prefix):]
        if rel.split("/", 1)[0] in FOREIGN:
            continue
        target = root.joinpath(*rel.split("/"))
        try:
            parent = ensure_dirs(root, target.parent, checked, family)
        except InTheWay:  # a file where the tree has a directory: left as it is
            placed.kept += 1
            continue
        except Refused as exc:  # another user's directory, a link, or none made
            placed.missing += isinstance(exc, Uncreatable)
            placed.kept += not isinstance(exc, Uncreatable)
            where = str(getattr(exc, "path", ""))
            if where not in refused:
                refused.add(where)
                log.warning("%s; the entries under it are left out", exc)
            continue
        try:
            _place_one(pool, parent, target, entry, link, now, placed, swept)
        except OSError as exc:
            if exc.errno in WHOLE_FS or isinstance(exc, LinkRefused):
                raise whole_filesystem(family, target, exc) from exc
            placed.missing += 1
            log.warning("%s: cannot place %s from the pool (%s); the tool builds it",
                        family, target, exc)
    return placed



def _place_one(pool: ArtifactPool, parent: Path, target: Path, entry: TreeEntry,
               link: bool, now: int, placed: Placed, swept: set[Path]) -> None:
    """Place one entry at ``target`` unless something is there, and count it."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None:
        # Not hashed: whatever is there stays, so this only sorts the counts.
        same = stat.S_ISREG(st.st_mode) and st.st_size == entry.size
        placed.present += same
        placed.kept += not same
        return
    data = pool.get(entry.sha256)
    if data is None:
        placed.missing += 1
        return
    if parent not in swept:
        swept.add(parent)
        _sweep_stale(parent)
    if _place(pool, parent, target, data, entry, link, now):
        placed.written += 1
        placed.bytes += len(data)
    else:
        placed.present += 1


#: Seconds after which a temporary file of a placement is taken for one whose writer
#: was killed (a placement writes one file in well under that); as the pool's own.
STALE_TMP_S = STALE_TMP_SECONDS
_TMP_SUFFIX = ".distcache.tmp"


def _sweep_stale(directory: Path) -> None:
    """Remove the temporary files placements killed mid-write left in ``directory``
    (hidden, so no tool and no later placement would ever see or replace them),
    once they are :data:`STALE_TMP_S` old: a live writer elsewhere on a shared
    directory finishes long before."""
    cutoff = time.time() - STALE_TMP_S
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if not (entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX)):
            continue
        with contextlib.suppress(OSError):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff and st.st_uid == os.geteuid():
                os.unlink(entry.path)


def _place(pool: ArtifactPool, parent: Path, target: Path, data: bytes, entry: TreeEntry,
           link: bool, now: int) -> bool:
    """Put ``data`` at ``target`` unless something is there; whether this wrote it.
    A copy gets ``entry``'s time, if any, but never one later than ``now``."""
    if link:
        with contextlib.suppress(OSError):
            os.link(pool.layout.object_path(entry.sha256), target)
            return True
        if os.path.lexists(target):
            return False
    # At most 64 bytes of the name (not characters: a name of 255 bytes would not
    # leave room for the rest).
    hint = target.name.encode("utf-8", "ignore")[:64].decode("utf-8", "ignore")
    tmp = parent / f".{hint}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, entry.mode | 0o400)
        os.fsync(fd)
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno in NO_LINKS:
                raise LinkRefused(exc.errno, exc.strerror, str(target)) from exc
            raise
        if entry.mtime_ns is not None:
            # Only once linked: until then the temporary file keeps the time it was
            # written, so another placement's sweep never takes it for a stale one.
            # min() keeps the tree's order of times (ninja compares them with <);
            # a time this filesystem cannot hold leaves the file with its own.
            with contextlib.suppress(OSError, OverflowError, ValueError):
                os.utime(fd, ns=(now, min(entry.mtime_ns, now)))
        return True
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
