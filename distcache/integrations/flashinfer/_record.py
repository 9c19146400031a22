"""The FlashInfer usage record: which kernels this job's ranks asked for.

FlashInfer selects kernels lazily, per rank, the first time a request shape needs
one, so the kernels a job needs are only known after it has served traffic. The
loader wrapper appends every ``(name, sha256)`` it resolves to a per-process file
under a record directory; the next launch merges the files of every rank and
prefetches them collectively, so a kernel first used on one rank is already in every
pool before serving starts.

Files are ``sha256sum`` format (``<sha256>  <name>``), one per process
(``<host>-<pid>[-rank<r>].txt``). Each line is written with a single ``write()`` on
an ``O_APPEND`` descriptor, which POSIX makes atomic with respect to other appenders,
so processes sharing a directory (even sharing a file) never interleave lines.

The record is compacted when it is read (:func:`read_record`), so that it does not
grow by one file per process per launch: the files this host's finished processes
wrote are merged into one file per host, ``<host>.compact.txt``, which replaces the
previous one atomically, and are then removed. A writer holds a shared ``flock`` on
its file while it is open; the compactor merges only the files it can lock
exclusively (whose writers are gone), and a writer that reopens a file the compactor
removed opens a new one. The record is bounded: at most :data:`MAX_ENTRIES` names
are kept, the least recently recorded dropped first. A name recorded with two digests
(FlashInfer was upgraded) keeps the newest (the later file by modification time, the
later line within a file), with one warning, and the compacted file holds only that.
The merged file counts as written at the time of its newest source, so a process that
started before an upgrade and finishes after it cannot bring an older digest back.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.errors import PoolError
from distcache.integrations.flashinfer._record_lines import _lines, _open_regular

log = get_logger(__name__)

RECORD_SUFFIX = ".txt"
#: The per-host file that read_record merges finished processes' files into.
COMPACT_SUFFIX = ".compact" + RECORD_SUFFIX
#: At most this many names are kept (a family of FlashInfer kernels is ~16,000; a
#: deployment uses a small part of it); the least recently recorded go first.
MAX_ENTRIES = 100_000
#: How long a reader waits for another process's compaction before reading without.
_LOCK_WAIT_SECONDS = 10.0
# The launcher variables that carry a global rank, most specific first. The rank is
# only a readable tag in the file name; host and pid already make it unique.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def record_file_name(environ: Mapping[str, str] | None = None) -> str:
    """``<host>-<pid>[-rank<r>].txt`` for this process."""
    env = os.environ if environ is None else environ
    name = f"{_host()}-{os.getpid()}"
    for var in _RANK_VARS:
        value = env.get(var, "").strip()
        if value.isdigit():
            name += f"-rank{int(value)}"
            break
    return name + RECORD_SUFFIX


class Recorder:
    """Appends each distinct ``(name, sha256)`` once to this process's record file.

    The directory is created on first use. Thread-safe; a failing write is logged
    once and recording stops (a usage record must never break serving). A process
    forked from this one (an engine's worker) records into a file of its own
    (:func:`record_file_name` with its pid; a given ``file_name`` is kept, each line
    still one ``O_APPEND`` write): it never writes as its parent, nor waits on a lock
    a thread of the parent held at the fork.
    """

    def __init__(self, directory: str | os.PathLike[str], file_name: str | None = None) -> None:
        self.directory = Path(directory)
        self._named = file_name is not None
        self.path = self.directory / (file_name or record_file_name())
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._broken = False
        self._finished = False
        _RECORDERS.add(self)

    def _forked(self) -> None:
        """In a forked child: let go of the parent's descriptor (its shared lock
        stays the parent's) and name the child's own file."""
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if not self._named:
            self.path = self.directory / record_file_name()

    def add(self, name: str, sha256: str) -> bool:
        """Record one request; returns ``True`` when a line was written."""
        key = (name, sha256)
        with self._lock:
            if key in self._seen or self._broken or self._finished:
                return False
            line = f"{sha256}  {name}\n".encode()
            try:
                if self._fd is None:
                    self._fd = self._open()
                # One write per line: O_APPEND makes each write land whole at the end.
                written = os.write(self._fd, line)
                if written != len(line):
                    raise OSError(f"short write ({written} of {len(line)} bytes)")
            except OSError as exc:
                self._broken = True
                log.warning("flashinfer usage record %s disabled: %s", self.path, exc)
                return False
            self._seen.add(key)
            return True

    def _open(self) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = _open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)
            if fd is None:
                raise OSError(f"{self.path} is not a regular file")
            try:
                # Shared: tells a compactor this file is live. It waits only while a
                # compaction holds the file; one that removed it meanwhile leaves it
                # unlinked, and the line goes to a new file instead.
                fcntl.flock(fd, fcntl.LOCK_SH)
                if os.fstat(fd).st_nlink > 0:
                    return _after_torn_line(fd)
            except OSError:
                # No flock here (some network filesystems): append anyway.
                return _after_torn_line(fd)
            os.close(fd)

    def close(self, *, final: bool = False) -> None:
        """Close the file; idempotent. A later :meth:`add` reopens it, unless ``final``
        (the wrapper was uninstalled: a load still in flight must not reopen the file
        and keep its descriptor and lock for the rest of the process)."""
        with self._lock:
            self._finished = self._finished or final
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


#: Every live recorder of this process, renamed in a forked child.
_RECORDERS: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for recorder in list(_RECORDERS):
        recorder._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_torn_line(fd: int) -> int:
    """``fd``, first ended with a newline when its file does not end in one (a write
    cut short by a crash or a full disk, by a process of the same name): the next line
    then stands alone instead of being glued onto the torn one."""
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")
    except OSError:
        pass  # opened write-only somewhere pread is refused: the reader copes
    return fd


def read_record(directory: str | os.PathLike[str], *, max_entries: int = MAX_ENTRIES,
                compact: bool = True) -> dict[str, str]:
    """``name -> sha256`` from every record file in ``directory`` (missing: empty),
    at most ``max_entries`` names (the most recently recorded); with ``compact``,
    compacts this host's files on the way (see the module's docstring), else reads
    them as they are and writes nothing. A name recorded with two digests keeps the
    newest, with one warning.

    A write cut short by a crash or a full disk is skipped, with a warning: a final
    line without a newline, or one that stops before its name. An entry that is not a
    regular file (a FIFO, a directory) is skipped, with a warning.

    Raises:
        ManifestError: a malformed line (one longer than a name allows is not read on).
        ArtifactNameError: a recorded name is unsafe.
        PoolError: the directory cannot be read.
    """
    root = Path(directory)
    if not root.exists():
        return {}
    resolved: dict[str, tuple[str, str]] = {}
    with _compaction_lock(root) if compact else contextlib.nullcontext(False) as locked:
        if locked:
            resolved = _compact(root, max_entries)
        for _attempt in range(3):
            try:
                files = [path for _mtime, path in _record_files(root)]
                entries, conflicts = _newest(_read_files(files), max_entries)
                break
            except FileNotFoundError:
                # A compactor on another host published its merged file and removed
                # the ones it merged between the listing and the read: list again.
                continue
        else:
            raise PoolError(f"usage record {root} kept changing while it was read; "
                            "try again", path=str(root))
    conflicts = {**resolved, **conflicts}
    if conflicts:
        name, (old, new) = next(iter(conflicts.items()))
        log.warning("usage record %s: %d name(s) recorded with two digests (an upgrade?); "
                    "kept the newest: %s %s..., was %s...", root, len(conflicts), name,
                    new[:12], old[:12])
    return entries


def recorded_ns(directory: str | os.PathLike[str]) -> int | None:
    """When the usage record in ``directory`` was last written (the newest record
    file's modification time, in ns), or ``None`` when it has none: how records of
    different nodes are dated against each other."""
    root = Path(directory)
    if not root.is_dir():
        return None
    files = _record_files(root)
    return files[-1][0] if files else None


def _record_files(root: Path) -> list[tuple[int, Path]]:
    """``(mtime_ns, path)`` of the record files in ``root``, oldest first."""
    try:
        with os.scandir(root) as listing:
            found = []
            for entry in listing:
                if entry.name.endswith(RECORD_SUFFIX) and not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        found.append((entry.stat().st_mtime_ns, entry.name))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise PoolError(f"cannot list usage record {root}: {exc.strerror}", path=str(root)) from exc
    return [(mtime, root / name) for mtime, name in sorted(found)]


def _read_files(files: list[Path]) -> Iterator[Artifact]:
    for path in files:
        yield from _lines(path)


def _newest(artifacts: Iterator[Artifact], max_entries: int
            ) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """The last ``max_entries`` names, ``name -> sha256`` in recording order (a name
    seen again moves to the end), and ``name -> (older, newer)`` for each of them seen
    with two digests. The oldest name goes as soon as there are too many."""
    entries: OrderedDict[str, str] = OrderedDict()  # drops its oldest in O(1)
    conflicts: dict[str, tuple[str, str]] = {}
    for artifact in artifacts:
        previous = entries.pop(artifact.name, None)
        if previous is not None and previous != artifact.sha256:
            conflicts[artifact.name] = (previous, artifact.sha256)
        entries[artifact.name] = artifact.sha256
        if len(entries) > max_entries:
            conflicts.pop(entries.popitem(last=False)[0], None)
    return dict(entries), conflicts


@contextlib.contextmanager
def _compaction_lock(root: Path) -> Iterator[bool]:
    """Hold ``root/.compact.lock`` exclusively; yields whether it is held (False in a
    directory this process cannot write: the record is then only read)."""
    try:
        fd = os.open(root / ".compact.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError:
        yield False
        return
    try:
        yield _lock(fd)
    finally:
        os.close(fd)


def _lock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` within :data:`_LOCK_WAIT_SECONDS`; whether it
    is held (a compactor that never finishes, or no flock here: read without it)."""
    deadline = time.monotonic() + _LOCK_WAIT_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        except OSError:
            return False


def _compact(root: Path, max_entries: int) -> dict[str, tuple[str, str]]:
    """Merge the files of this host's finished processes into ``<host>.compact.txt``
    (written whole, then renamed into place), then remove them; returns the names
    it found with two digests (``name -> (older, newer)``; only the newer is kept).
    Never raises for want of permission or space: the record is then read as it is."""
    host = _host()
    mine = re.compile(re.escape(host) + r"-\d+(-rank\d+)?" + re.escape(RECORD_SUFFIX))
    compact = root / (host + COMPACT_SUFFIX)
    held: list[tuple[Path, int]] = []
    try:
        newest = 0
        # The merged file and the finished ones are merged oldest first, so the newest
        # digest wins even when a process that was running at the last compaction
        # wrote an older one (a tie puts the finished file last).
        sources: list[tuple[int, bool, Path]] = []
        for mtime, path in _record_files(root):
            if path == compact:
                newest = max(newest, mtime)
                sources.append((mtime, False, path))
            if not mine.fullmatch(path.name):
                continue
            try:
                if (fd := _open_regular(path, os.O_RDONLY)) is None:
                    continue  # a FIFO, a directory: not a record file
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while it is written
            except OSError:
                os.close(fd)
                continue
            held.append((path, fd))
            sources.append((mtime, True, path))
            newest = max(newest, mtime)
        if not held:
            return {}
        entries, conflicts = _newest(_read_files([s[2] for s in sorted(sources)]), max_entries)
        tmp = root / f".{host}.{os.getpid()}.compact.tmp"
        try:
            tmp.write_text("".join(f"{h}  {n}\n" for n, h in entries.items()), encoding="utf-8")
            # Dated as its newest source, so that it sorts among the files of live
            # processes as what it merged would have: newest wins stays true.
            os.utime(tmp, ns=(newest, newest))
            os.replace(tmp, compact)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.debug("usage record %s not compacted: %s", root, exc)
            return {}
        for path, _fd in held:
            with contextlib.suppress(OSError):
                path.unlink()
        log.debug("usage record %s: merged %d file(s) into %s (%d names)", root, len(held),
                  compact.name, len(entries))
        return conflicts
    finally:
        for _path, fd in held:
            os.close(fd)
