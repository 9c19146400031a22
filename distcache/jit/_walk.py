"""What a family's directory holds: the files a scan lists (not the names a tool
writes only while it works, nor another integration's directory), and the owner
check every directory passes before it is filled or published.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from distcache.errors import JitCacheError

#: Names a tool writes while it works (temporary files, locks, build directories,
#: byte code stamped with a local time); never published.
TRANSIENT = ("*.tmp", "*.lock", "lock", ".*", "tmp.*", "*_CxxBuild", "__pycache__",
             "*.pyc", "locks")
#: Hidden names published all the same: ninja's build log and dependency log
#: (FlashInfer's JIT runs ninja in each op's directory; without them ninja rebuilds
#: every output it has no record of). Only ninja writes them, and only the
#: ``flashinfer_jit`` family's tool runs ninja in its directory.
KEPT = (".ninja_log", ".ninja_deps")
#: Directories at the top of a family's directory that hold another integration's
#: files, never published nor placed: FlashInfer's downloaded cubins
#: (``<FlashInfer's cache directory>/cubins``), which its loader integration serves.
FOREIGN = ("cubins",)


def transient(relpath: str, patterns: Sequence[str] = TRANSIENT) -> bool:
    """Whether any segment of ``relpath`` is a name tools write only while working."""
    return any(fnmatch.fnmatchcase(seg, pat) for seg in relpath.split("/") for pat in patterns)


def check_owner(directory: Path, *, family: str) -> None:
    """Refuse ``directory`` unless it is a directory owned by this process's user,
    and not a symbolic link (whoever made the link chose where the files would go).

    Raises:
        JitCacheError: it is owned by another user, is a link, or is not a directory.
    """
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise JitCacheError(f"{family}: cannot read {directory}: {exc}", family=family,
                            path=str(directory)) from exc
    if stat.S_ISLNK(st.st_mode):
        raise JitCacheError(
            f"{family}: refusing to fill {directory}: it is a symbolic link (to "
            f"{os.readlink(directory)!r}); point the tool at the directory itself",
            family=family, path=str(directory))
    if not stat.S_ISDIR(st.st_mode):
        raise JitCacheError(f"{family}: {directory} is not a directory", family=family,
                            path=str(directory))
    if st.st_uid != os.geteuid():
        raise JitCacheError(
            f"{family}: refusing to fill {directory}: it belongs to uid {st.st_uid}, not "
            f"to this user (uid {os.geteuid()}); a JIT cache holds code the engine runs, "
            "so point the tool at a directory of your own", family=family,
            path=str(directory))


def walk(root: Path) -> Iterator[tuple[str, Path]]:
    """``(relative path, path)`` of every regular file under ``root`` (symbolic links
    are not followed and not listed; transient names but :data:`KEPT` ones, and the
    :data:`FOREIGN` directories at the top, are skipped)."""
    stack = [root]
    while stack:
        here = stack.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            rel = Path(entry.path).relative_to(root).as_posix()
            if (transient(entry.name) and entry.name not in KEPT) or rel in FOREIGN:
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                yield rel, Path(entry.path)
