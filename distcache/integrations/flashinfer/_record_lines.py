"""Reading a FlashInfer usage record file a line at a time (see
:mod:`distcache.integrations.flashinfer._record`), and opening one only when it is a
regular file."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from distcache._log import get_logger
from distcache.artifact import MAX_NAME_BYTES, Artifact
from distcache.errors import ArtifactNameError, ManifestError, PoolError

log = get_logger("distcache.integrations.flashinfer._record")

_LINE_RE = re.compile(r"^([0-9a-f]{64})  (\S.*)$")
#: A line cut short before its name began (a crash, a full disk) and ended later.
_TORN_RE = re.compile(r"^[0-9a-f]{1,64} {0,2}$")
#: The longest line a record holds (a sha256, two blanks, the longest name, a newline).
_MAX_LINE = 64 + 2 + MAX_NAME_BYTES + 1


def _open_regular(path: Path, flags: int) -> int | None:
    """A descriptor on ``path`` opened with ``flags``, or ``None`` when it is not a
    regular file (a FIFO, a device or a directory under a record name: opening does
    not wait for a FIFO's other end, and nothing is read from or written to it)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None



def _lines(path: Path) -> Iterator[Artifact]:
    """The artifacts recorded in ``path``, in order, read a line at a time.

    Raises:
        FileNotFoundError: the file is gone (a compactor removed it).
    """
    try:
        fd = _open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise PoolError(f"cannot read usage record {path}: {exc}", path=str(path)) from exc
    if fd is None:
        log.warning("%s: not a regular file; ignored", path)
        return
    torn = 0
    with open(fd, "rb") as file:
        for lineno, raw in enumerate(iter(lambda: file.readline(_MAX_LINE + 1), b""), 1):
            try:
                line = raw.decode() if len(raw) <= _MAX_LINE else raw[:120].decode(errors="replace")
            except UnicodeDecodeError as exc:
                raise PoolError(f"cannot read usage record {path}: {exc}", path=str(path)) from exc
            if len(raw) <= _MAX_LINE and not line.endswith("\n"):
                log.warning("%s: ignoring a truncated last line %r", path, line[:80])
                break
            line = line.removesuffix("\n")
            torn += bool(_TORN_RE.match(line))  # cut short, then appended to: skipped
            if not line.strip() or _TORN_RE.match(line):
                continue
            match = _LINE_RE.match(line) if len(raw) <= _MAX_LINE else None
            if match is None:  # a line longer than a name allows is not read on
                raise ManifestError(f"{path}:{lineno}: expected '<64 hex sha256>  <name>', got "
                                    f"{line[:120]!r}", line=lineno, text=line, source=str(path))
            try:
                artifact = Artifact(match[2], match[1])
            except ArtifactNameError as exc:
                raise ArtifactNameError(f"{path}:{lineno}: {exc.message}", name=match[2],
                                        reason=getattr(exc, "reason", str(exc)),
                                        line=lineno) from None
            yield artifact
    if torn:
        log.warning("%s: ignoring %d line(s) cut short by an interrupted write", path, torn)
