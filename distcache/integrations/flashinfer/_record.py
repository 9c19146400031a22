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
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from distcache.artifact import Artifact, merge_manifests
from distcache.errors import ArtifactNameError, ManifestError, PoolError

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".txt"
_LINE_RE = re.compile(r"^([0-9a-f]{64})  (\S.*)$")
# The launcher variables that carry a global rank, most specific first. The rank is
# only a readable tag in the file name; host and pid already make it unique.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def record_file_name(environ: Mapping[str, str] | None = None) -> str:
    """``<host>-<pid>[-rank<r>].txt`` for this process."""
    env = os.environ if environ is None else environ
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    name = f"{host}-{os.getpid()}"
    for var in _RANK_VARS:
        value = env.get(var, "").strip()
        if value.isdigit():
            name += f"-rank{int(value)}"
            break
    return name + RECORD_SUFFIX


class Recorder:
    """Appends each distinct ``(name, sha256)`` once to this process's record file.

    The directory is created on first use. Thread-safe; a failing write is logged
    once and recording stops (a usage record must never break serving).
    """

    def __init__(self, directory: str | os.PathLike[str], file_name: str | None = None) -> None:
        self.directory = Path(directory)
        self.path = self.directory / (file_name or record_file_name())
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._broken = False

    def add(self, name: str, sha256: str) -> bool:
        """Record one request; returns ``True`` when a line was written."""
        key = (name, sha256)
        with self._lock:
            if key in self._seen or self._broken:
                return False
            line = f"{sha256}  {name}\n".encode()
            try:
                if self._fd is None:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    self._fd = os.open(
                        self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
                    )
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

    def close(self) -> None:
        """Close the file; idempotent. A later :meth:`add` reopens it."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_record(directory: str | os.PathLike[str]) -> dict[str, str]:
    """``name -> sha256`` from every record file in ``directory`` (missing: empty).

    A final line without a newline is a write cut short by a crash and is skipped.

    Raises:
        ManifestError: a malformed line, or one name recorded with two digests.
        ArtifactNameError: a recorded name is unsafe.
        PoolError: the directory cannot be read.
    """
    root = Path(directory)
    try:
        files = sorted(p for p in root.iterdir() if p.name.endswith(RECORD_SUFFIX))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise PoolError(f"cannot list usage record {root}: {exc.strerror}", path=str(root)) from exc
    merged = merge_manifests(part for path in files for part in _lines(path))
    return {a.name: a.sha256 for a in merged}


def _lines(path: Path) -> Iterator[tuple[str, list[Artifact]]]:
    """One ``("<file>:<line>", [artifact])`` part per recorded line, so that a name
    recorded with two digests is reported with both places."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PoolError(f"cannot read usage record {path}: {exc}", path=str(path)) from exc
    lines = text.split("\n")
    if lines and lines[-1]:
        log.warning("%s: ignoring a truncated last line %r", path, lines[-1][:80])
    for lineno, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        match = _LINE_RE.match(line)
        if match is None:
            raise ManifestError(
                f"{path}:{lineno}: expected '<64 hex sha256>  <name>', got {line[:120]!r}",
                line=lineno,
                text=line,
            )
        sha, raw_name = match.groups()
        try:
            artifact = Artifact(raw_name, sha)
        except ArtifactNameError as exc:
            raise ArtifactNameError(
                f"{path}:{lineno}: {exc.message}", name=raw_name,
                reason=getattr(exc, "reason", str(exc)),
            ) from None
        yield f"{path}:{lineno}", [artifact]
