"""Trimming ``quarantine/``: it is outside the size cap, so a medium that keeps
corrupting objects, or names that keep being planted over objects, would otherwise
fill the disk with what was moved there.

A bad object's name may hold anything when it is moved aside (a file, a symlink, a
fifo, a whole directory), so an entry is removed whatever its kind: a directory with
everything in it, without ever following a symlink out of the pool (``quarantine/``
itself is opened without following a link, and a directory's tree is removed through
descriptors, each link removed, never walked through).
"""

from __future__ import annotations

import os
import stat

from distcache._log import get_logger
from distcache.store._reading import DIR_FLAGS
from distcache.store.layout import PoolLayout

logger = get_logger(__name__)


def trim_quarantine(layout: PoolLayout, keep: int) -> int:
    """Delete all but the ``keep`` newest entries of ``quarantine/``, of every kind,
    ordered by the time in their names (a rename keeps the object's old mtime).
    Names the layout did not make (an operator's notes) are left alone. Returns the
    number deleted; an entry that cannot be deleted (another user's) is logged and
    left, never raised."""
    try:
        fd = os.open(layout.quarantine, DIR_FLAGS)
    except OSError:
        return 0  # absent, or a planted link: nothing of this pool's to trim
    try:
        entries: list[tuple[int, str]] = []
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    when = layout.quarantined_at(entry.name)
                    if when is not None:
                        entries.append((when, entry.name))
        except OSError:
            return 0
        entries.sort(reverse=True)
        removed = 0
        failed: list[tuple[str, OSError]] = []
        for _when, name in entries[max(keep, 0):]:
            try:
                _remove(fd, name)
            except FileNotFoundError:
                continue  # another process trimmed it first
            except OSError as exc:
                failed.append((name, exc))
                continue
            removed += 1
    finally:
        os.close(fd)
    if failed:
        first, error = failed[0]
        logger.warning("cannot remove %d old entries of %s (e.g. %s: %s); quarantine/ keeps "
                       "growing until they are removed by their owner or root",
                       len(failed), layout.quarantine, first, error.strerror or error)
    return removed


def _remove(directory: int, name: str) -> None:
    """Remove the entry ``name`` of the directory open as ``directory``: a directory
    with its whole tree, anything else (a symlink itself, never its target) unlinked.

    Raises:
        OSError: it cannot be removed (``FileNotFoundError``: it is gone).
    """
    st = os.stat(name, dir_fd=directory, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        # Descriptor-based: a symlink inside is unlinked, and a directory swapped for
        # a link meanwhile is refused, not followed.
        import shutil  # only here: its import loads bz2 and lzma

        shutil.rmtree(name, dir_fd=directory)
    else:
        os.unlink(name, dir_fd=directory)
