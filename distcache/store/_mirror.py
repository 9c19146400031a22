"""The directory a ``pool export DIR`` writes: an earlier export found there (which a
new one carries over, checked), the new tree built beside it or, where it cannot be
(``DIR`` is a mount point, or its parent cannot be written), inside it, and putting
that tree in place or taking it back."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import Artifact, path_under, read_manifest, sha256_hex
from distcache.errors import ArtifactNameError, ConfigError, ManifestError, PoolError
from distcache.store._fs import (
    CREATE_FLAGS,
    READ_FLAGS,
    fsync_dir,
    fsync_path,
    read_fd,
    sync_filesystem,
    write_all,
)
from distcache.store._import import MANIFEST
from distcache.store._reading import file_holds

logger = get_logger(__name__)


def built_inside(target: Path) -> bool:
    """Whether the new tree must be built inside ``target``, not beside it: ``target``
    is a mount point (nothing can be renamed over it), its parent cannot be written, or
    it is this process's working directory or holds it (renamed away, it would leave
    the shell that ran the export in a removed directory, which lists empty)."""
    return os.path.isdir(target) and (os.path.ismount(target)
                                      or not os.access(target.parent, os.W_OK | os.X_OK)
                                      or _holds_cwd(target))


def _holds_cwd(target: Path) -> bool:
    try:
        here = os.getcwd()
    except OSError:  # the working directory is gone already
        return False
    top = os.path.realpath(target)
    return here == top or here.startswith(top.rstrip("/") + "/")


def beside(target: Path, tag: str = "tmp") -> Path:
    """A fresh name beside ``target`` for what becomes it (or what it is moved aside
    to): process-unique (pid and random bits), so neither a stale entry of a killed
    run whose pid came round again nor another host's export on a shared volume holds it."""
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(6)}.{tag}")


def staging(target: Path, inside: bool) -> Path:
    """A fresh name for the new tree: beside ``target``, or inside it (naming this host,
    so that a later export can tell a tree left by a killed run: :func:`clear_stale`)."""
    return beside(target / f"distcache-export.{_HOST}" if inside else target, "new")


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", os.uname().nodename) or "host"
#: A tree :func:`staging` names inside the target (older ones name no host).
_STAGED = re.compile(r"\.distcache-export\.(?:([A-Za-z0-9-]+)\.)?(\d+)\.[0-9a-f]{12}\.new")


def clear_stale(target: Path) -> None:
    """Remove the trees that exports killed on this host left being built inside
    ``target`` (their process is gone). PoolError for one of a live process, or of
    another host, or one whose name says no host (which host's pid it names is not
    known): what to remove if no export runs there."""
    with os.scandir(target) as entries:
        staged = [(e, _STAGED.fullmatch(e.name)) for e in entries]
    for entry, found in staged:
        if found is None or not entry.is_dir(follow_symlinks=False):
            continue
        host, pid = found.group(1), int(found.group(2))
        if host == _HOST and not _alive(pid):
            remove_tree(Path(entry.path))
            continue
        raise PoolError(f"cannot export to {target}: an export by process {pid} on "
                        f"{host or 'an unnamed host'} "
                        f"is being built in {entry.path}; wait for it to end, or remove "
                        f"{entry.path} if no export runs there", path=str(target))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # another user's process
    return True


def move_into(new: Path, target: Path) -> None:
    """Put the tree built inside ``target`` in place, file by file (each renamed over
    the earlier one), its ``checksums.txt`` last; then remove what is left of it. An
    interruption here can leave ``target`` part-way: exporting the same artifacts
    again completes it (:func:`earlier_export` takes the files already moved)."""
    for directory, _dirs, files in os.walk(new):
        rel = os.path.relpath(directory, new)
        for name in files:
            if rel != "." or name != MANIFEST:
                dest = target / rel / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(os.path.join(directory, name), dest)
    os.replace(new / MANIFEST, target / MANIFEST)
    shutil.rmtree(new)


def refused(target: Path, why: str) -> PoolError:
    return PoolError(f"cannot export to {target}: {why}; an export replaces its directory "
                     "whole, so it goes only into a new or empty directory or over an earlier "
                     "export: give another directory, or move that away", path=str(target))


def first_stray(top: Path, prefix: str, listed: set[str],
                wanted: dict[str, Artifact]) -> str | None:
    """The first entry under ``top`` (its path from the export's top) that is neither
    a real directory nor a regular file ``listed`` names or that holds the bytes of
    the artifact of its name in ``wanted``; None when there is none."""
    with os.scandir(top) as entries:
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                found = first_stray(Path(entry.path), rel + "/", listed, wanted)
                if found is not None:
                    return found
            elif not (entry.is_file(follow_symlinks=False) and (
                    rel in listed or (rel in wanted and file_holds(entry.path, wanted[rel].sha256)))):
                return rel
    return None


def earlier_export(target: Path, wanted: dict[str, Artifact] | None = None
                   ) -> dict[str, Artifact] | None:
    """The artifacts the earlier export at ``target`` lists, by name; None when it is
    absent or empty. PoolError when it holds anything but a ``checksums.txt`` and the
    regular files that lists (in real directories): that would go with the earlier
    export when the new one takes its place. With ``wanted``, the artifacts of an
    export built inside ``target`` (which an interrupted one leaves part-way), trees
    that killed ones left are removed first (:func:`clear_stale`), and a file that
    holds the bytes of the artifact of its name there is none (no ``checksums.txt``
    at all then reads as an earlier export that lists nothing)."""
    manifest = target / MANIFEST
    try:
        if wanted is not None:
            clear_stale(target)
        if not os.listdir(target):
            return None
        if wanted is not None and not os.path.lexists(manifest):
            listed: dict[str, Artifact] = {}
            stray = first_stray(target, "", set(), wanted)
        elif stat.S_ISREG(os.lstat(manifest).st_mode):
            listed = {a.name: a for a in read_manifest(manifest)}
            stray = first_stray(target, "", {*listed, MANIFEST}, wanted or {})
        else:
            listed, stray = {}, MANIFEST
    except PoolError:
        raise
    except FileNotFoundError as exc:
        if exc.filename is not None and Path(exc.filename) == target:
            return None
        raise refused(target, f"it holds no {MANIFEST}, so no earlier export") from None
    except (ConfigError, ManifestError, ArtifactNameError) as exc:
        raise refused(target, f"its {MANIFEST} cannot be read as an export's ({exc})") from exc
    except OSError as exc:
        raise PoolError(f"cannot export to {target}: it cannot be read ({exc.strerror or exc})",
                        path=str(target), errno=exc.errno) from exc
    if stray is not None:
        raise refused(target, f"it holds {stray}, which no {MANIFEST} of an export lists")
    return listed


def carried(target: Path, artifact: Artifact) -> bytes:
    """The bytes of ``artifact`` in the earlier export at ``target``, checked against
    the sha256 its ``checksums.txt`` lists, which the new one lists again (PoolError)."""
    try:
        fd = os.open(path_under(target, artifact.name), READ_FLAGS)
        try:
            data = read_fd(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    except OSError as exc:
        raise refused(target, f"{artifact.name}, which its {MANIFEST} lists, cannot be "
                               f"read ({exc.strerror or exc})") from exc
    if sha256_hex(data) != artifact.sha256:
        raise refused(target, f"{artifact.name} no longer matches the sha256 its "
                               f"{MANIFEST} lists (it changed since it was exported)")
    return data


def write_file(top: Path, name: str, data: bytes, mode: int) -> None:
    """Create ``top/<name>`` (and its directories) holding ``data``, mode ``mode``;
    ``top`` is the export's new directory (``0700`` until complete): nothing is in the way."""
    path = path_under(top, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, CREATE_FLAGS, 0o600)
        try:
            write_all(fd, data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    except OSError as exc:
        raise PoolError(f"cannot export {name}: cannot write {path} ({exc.strerror or exc}); "
                        "nothing was exported", path=str(path), errno=exc.errno) from exc


def flush_tree(top: Path) -> None:
    """Flush the new tree before its rename: one ``syncfs``, else file by file."""
    if not sync_filesystem(top):
        for directory, _dirs, files in os.walk(top):
            for name in files:
                fsync_path(os.path.join(directory, name))
            fsync_dir(directory)


def remove_tree(tree: Path) -> None:
    """Remove a tree this export made or moved aside (never anyone else's)."""
    shutil.rmtree(tree, ignore_errors=True)
    if os.path.lexists(tree):
        logger.warning("cannot remove %s, left by an export; remove it by hand", tree)


def undo(new: Path, target: Path, aside: Path | None) -> None:
    """After a failure or an interrupt: put the earlier export back and remove the new
    tree, or, where that is in place already, remove the earlier one."""
    if os.path.lexists(new):
        if aside is not None and os.path.lexists(aside) and not os.path.lexists(target):
            with contextlib.suppress(OSError):
                os.rename(aside, target)
        remove_tree(new)
    elif aside is not None:  # renamed in already: the export is whole
        remove_tree(aside)
