"""``distcache doctor``: what this machine offers distcache, one fact per line.

Reports the launcher (``launch.detect()``), the pool directory, the filesystem it is
on (kernel locks are only as good as the filesystem: some NFS and Lustre mounts
accept ``flock`` without excluding anyone, which costs duplicate downloads, never
correctness), whether locks really exclude there, free space, ``/dev/shm`` (the CPU
IPC pools live there; containers often cap it at 64 MiB), and CUDA IPC, as the IPC
package's own probe sees it. That probe imports torch, so it runs only where an NVIDIA
device node exists: elsewhere its answer is known and not worth torch's import time.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from distcache import __version__
from distcache._urls import redact_url
from distcache.cli._common import (
    EXIT_OK,
    add_json_option,
    emit,
    human_bytes,
    one_line,
    pool_root,
)
from distcache.config import settings
from distcache.errors import PoolError
from distcache.ipc import probe_cuda_ipc
from distcache.ipc._shm import SHM_DIR
from distcache.store import FORMAT_VERSION, PoolLayout
from distcache.store._fs import READ_FLAGS
from launch import detect

# Filesystems where flock may be node-local or advisory only (DESIGN.md, pool), by
# their exact type; FUSE ones (``fuse``, ``fuse.sshfs``) may be, ``fuseblk`` is a disk.
_NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "ceph"})


def setup_doctor(parser: argparse.ArgumentParser) -> None:
    """Add the ``doctor`` options to its parser."""
    add_json_option(parser)
    parser.set_defaults(run=run_doctor)


def _existing(path: Path) -> Path:
    """The nearest of ``path`` and its parents that this user can see exists."""
    path = Path(os.path.abspath(path))
    while path != path.parent:
        with contextlib.suppress(OSError):  # a parent it cannot enter: look further up
            if path.exists():
                break
        path = path.parent
    return path


def _unescape(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_of(path: Path, mounts: str | None = None) -> tuple[str, str, str] | None:
    """``(fstype, mount point, device)`` of the longest mount point holding ``path``,
    from ``/proc/mounts`` (or the given text); ``None`` when unknown."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    real = os.path.realpath(_existing(path))
    best: tuple[str, str, str] | None = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        device, mount, fstype = _unescape(fields[0]), _unescape(fields[1]), fields[2]
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best[1])):
            best = (fstype, mount, device)
    return best


def check_locks(directory: Path) -> str:
    """Whether ``flock`` excludes a second open file description in ``directory``."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".doctor-lock-")
    except OSError as exc:
        return f"cannot test: no temporary file in {directory} ({exc.strerror})"
    try:
        with open(fd, "rb") as first, open(name, "rb") as second:
            return _exclusion(directory, first.fileno(), second.fileno())
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _exclusion(directory: Path, first: int, second: int) -> str:
    try:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return (f"do not work in {directory} ({errno.errorcode.get(exc.errno or 0, exc)}); "
                "concurrent processes may download the same artifact twice")
    try:
        fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "work (flock excludes a second holder)"
    except OSError as exc:
        return f"unclear in {directory}: second flock failed with {exc}"
    return (f"do not exclude in {directory}; concurrent processes may download the same "
            "artifact twice (correctness is unaffected)")


def _launcher() -> str:
    try:
        info = detect()
    except Exception as exc:  # a LaunchError, or any bug: doctor reports, never dies
        return f"inconsistent environment: {' '.join(str(exc).split())}"
    where = f"rank {info.rank} of {info.world_size}, node {info.node_id}"
    if info.local_rank is not None:
        where += f", local rank {info.local_rank}"
    used = f" (from {', '.join(info.source)})" if info.source else ""
    return f"{info.launcher}: {where}{used}"


def _gpu_device_present() -> bool:
    return Path("/dev/nvidia0").exists() or any(Path("/proc/driver/nvidia/gpus").glob("*"))


def _cuda_ipc() -> str:
    if not _gpu_device_present():
        return "not checked (no NVIDIA GPU device on this machine)"
    usable, reason = probe_cuda_ipc()
    if not usable:
        return f"unavailable: {reason}"
    import torch  # the probe has imported it already

    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return f"supported ({count} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda})"


def _shm() -> str:
    if not os.path.isdir(SHM_DIR):
        return "missing (CPU IPC pools need POSIX shared memory)"
    usage = shutil.disk_usage(SHM_DIR)
    return f"{human_bytes(usage.total)} total, {human_bytes(usage.free)} free"


def pool_state(root: Path) -> str:
    """What is at ``root`` as a pool: one that exists and every command can use, one
    they refuse (``NOT USABLE: why``), one only readable here, or none yet. Looks only:
    a pool of an older format is not migrated, nor is a missing pool made."""
    layout = PoolLayout(root)
    try:
        if not layout.is_pool(made_by_distcache=True):
            if not os.path.lexists(root) and _absent(root):
                return f"not created yet{_uncreatable(root)}"
            return ("NOT USABLE: not a directory" if not root.is_dir()
                    else f"not created yet; the directory exists{_uncreatable(root)}")
        found = _recorded_format(layout)
    except PoolError as exc:
        return f"NOT USABLE: {one_line(exc)}"
    except OSError as exc:  # a directory on the way this user cannot enter
        return f"NOT USABLE: cannot look into it: {exc.strerror or exc}"
    if found is not None and found > FORMAT_VERSION:
        return (f"NOT USABLE: on-disk format {found}, newer than format {FORMAT_VERSION}, "
                "the newest this version of distcache supports; upgrade distcache")
    if not os.access(layout.objects, os.R_OK | os.X_OK):
        return f"NOT USABLE: this user cannot list {layout.objects}"
    # What fetch, prefetch and import write (access() also says EROFS: a read-only mount).
    written = [layout.root, *layout.directories, layout.names_log, layout.journal_log]
    unwritable = [p for p in written if os.path.lexists(p) and not os.access(p, os.W_OK)]
    if unwritable:
        return (f"exists, read-only for this user: cannot write {unwritable[0]}; fetch, "
                "prefetch and import will fail here")
    return "exists"


def _recorded_format(layout: PoolLayout) -> int | None:
    """The format version in the pool's ``format`` file, or None when it has none or an
    empty one (a creator between its create and its write). Read once, at once: an
    empty file is neither waited out nor removed, as opening the pool would.

    Raises:
        PoolError: the file is not a regular file, cannot be read, or does not hold a
            format version.
    """
    try:
        fd = os.open(layout.format_file, READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PoolError(f"cannot read {layout.format_file}: {exc.strerror or exc}",
                        path=str(layout.format_file), errno=exc.errno) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PoolError(f"{layout.format_file} is not a regular file",
                            path=str(layout.format_file))
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return layout._parse_format(text) if text else None


def _uncreatable(root: Path) -> str:
    """Why this user cannot make a pool at ``root`` (empty when it can, as far as the
    nearest existing directory tells: ``access()`` also says EROFS, a read-only mount)."""
    where = _existing(root)
    if os.access(where, os.W_OK | os.X_OK):
        return ""
    return f"; cannot be created here: this user cannot write {where}"


def _fs_note(fstype: str) -> str:
    """What ``fstype`` means for the pool's locks (empty for a local filesystem)."""
    if fstype in _NETWORK_FS:
        return "; a network filesystem: locks may not exclude across nodes"
    if fstype == "fuse" or fstype.startswith("fuse."):
        return "; a FUSE filesystem, perhaps a network one: locks may not exclude across nodes"
    return ""


def _absent(path: Path) -> bool:
    """Whether ``path`` is not there (and not merely hidden by a parent this user
    cannot enter: :func:`os.path.lexists` says False for both).

    Raises:
        OSError: the path cannot be looked up.
    """
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    return False


def doctor_lines(pool_root: Path) -> list[tuple[str, str]]:
    """Every fact ``doctor`` reports, as ``(label, text)``, in order.

    Raises:
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    resolved = settings()
    lines = [("distcache", f"{__version__} (python {sys.version.split()[0]})"),
             ("launcher", _launcher())]
    lines.append(("pool", f"{pool_root} ({pool_state(pool_root)})"))
    probe = _existing(pool_root)
    fs = filesystem_of(probe)
    if fs is None:
        lines.append(("filesystem", "unknown (/proc/mounts unreadable)"))
    else:
        fstype, mount, device = fs
        lines.append(("filesystem", f"{fstype} on {mount} ({device}){_fs_note(fstype)}"))
    lines.append(("kernel locks", check_locks(probe)))
    usage = shutil.disk_usage(probe)
    lines.append(("free space", f"{human_bytes(usage.free)} of {human_bytes(usage.total)} at {probe}"))
    lines.append((SHM_DIR, _shm()))
    # A report gets pasted into tickets: no origin's password or signed query in it.
    origins = (", ".join(map(redact_url, resolved.origins)) if resolved.origins
               else "unset (DISTCACHE_ORIGIN)")
    lines.append(("origins", origins))
    lines.append(("cuda ipc", _cuda_ipc()))
    return lines


def run_doctor(args: argparse.Namespace) -> int:
    """``doctor``: one ``label: text`` line per fact, or a JSON object label -> text."""
    lines = doctor_lines(pool_root(args))
    width = max(len(label) for label, _ in lines)
    emit(args, dict(lines), (f"{label + ':':<{width + 1}} {text}" for label, text in lines))
    return EXIT_OK
