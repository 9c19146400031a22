"""A file read whole, up to a bound: a manifest, never a stream such as ``/dev/zero``,
nor a named pipe that no writer will ever open."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def _read_at_most(path: Path, limit: int) -> bytes:
    """The bytes of ``path``; ``OSError`` (``EFBIG``) past ``limit``. A regular file says
    so by its size; anything else (``/dev/zero``) is read, unbuffered, to ``limit + 1``.

    Opened without waiting: a named pipe (FIFO) is refused (``OSError``, ``ENXIO``)
    instead of waiting for ever for a writer; a pipe a shell made (``<(command)``,
    ``/dev/stdin`` fed by ``|``) is read as a stream."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    chunks: list[bytes] = []
    with open(fd, "rb", buffering=0) as file:
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode) and not shell_pipe(path):
            raise OSError(errno.ENXIO, "it is a named pipe (FIFO), not a regular file: "
                          "reading it would wait for a writer; write the manifest to a file "
                          "and pass that file")
        os.set_blocking(fd, True)  # a pipe's bytes are waited for, as a file's are read
        left = limit + 1 if not stat.S_ISREG(st.st_mode) or st.st_size <= limit else 0
        while left > 0 and (chunk := file.read(min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    if left <= 0:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes, the most a manifest may "
                      "hold (MAX_MANIFEST_BYTES): is it the right file?")
    return b"".join(chunks)


def shell_pipe(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (a FIFO by its stat) is an anonymous pipe reached through
    ``/dev/fd`` or ``/proc``: it resolves to ``pipe:[inode]``, which names no file."""
    real = os.path.realpath(path)
    return os.path.basename(real).startswith("pipe:[") and not os.path.lexists(real)
