"""A file read whole, up to a bound: a manifest, never a stream such as ``/dev/zero``,
nor a named pipe that no writer will ever open, nor a standard input that a launcher
forwards."""

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
    ``/dev/stdin`` fed by ``|``) is read as a stream, but not where it is the standard
    input of a process that a launcher started (:func:`forwarded_stdin`): ``OSError``
    (``EINVAL``) instead."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    chunks: list[bytes] = []
    with open(fd, "rb", buffering=0) as file:
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode) and not shell_pipe(path):
            raise OSError(errno.ENXIO, "it is a named pipe (FIFO), not a regular file: "
                          "reading it would wait for a writer; write the manifest to a file "
                          "and pass that file")
        launcher = forwarded_stdin(st)
        if launcher is not None:
            raise OSError(errno.EINVAL, f"it is this rank's standard input, which {launcher}; "
                          "write the manifest to a file every rank can read and pass that "
                          "file")
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


#: Launchers whose ranks cannot all read one standard input, by a variable each sets in
#: its ranks (its value: the job's size, or ``None`` where any size counts), and why.
_FORWARDING = (
    ("OMPI_COMM_WORLD_SIZE", None, "Open MPI forwards to rank 0 alone and may never close "
     "(rank 0 would wait for the end of the manifest for ever)"),
    ("PMIX_RANK", None, "a PMIx launcher (prterun) forwards to rank 0 alone and may never "
     "close (rank 0 would wait for the end of the manifest for ever)"),
    ("PMI_SIZE", "PMI_SIZE", "MPICH forwards to rank 0 alone (the other ranks read nothing)"),
    ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "torchrun's workers share (each would read part "
     "of the manifest, or none)"),
)


def forwarded_stdin(opened: os.stat_result) -> str | None:
    """Why a file whose stat is ``opened`` cannot serve as a manifest, where it is this
    process's standard input (not a regular file: a regular one is read from its start
    on every rank alike) and a launcher that forwards it to some ranks only started this
    process; else ``None``. A lone process fed by a shell's ``|`` reads it as before."""
    if stat.S_ISREG(opened.st_mode):
        return None
    try:
        stdin = os.fstat(0)
    except OSError:  # no standard input: the file is not it
        return None
    if (stdin.st_dev, stdin.st_ino) != (opened.st_dev, opened.st_ino):
        return None
    for variable, size, why in _FORWARDING:
        if variable in os.environ and (size is None or _more_than_one(os.environ.get(size))):
            return why
    return None


def _more_than_one(value: str | None) -> bool:
    try:
        return value is not None and int(value) > 1
    except ValueError:
        return False
