"""A file read whole, up to a bound: a manifest, never a stream such as ``/dev/zero``,
nor a named pipe that no writer will ever open, nor a standard input that a launcher
forwards."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from distcache._proc import ancestors, name


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
        launcher = forwarded_stdin(path, st)
        if launcher is not None:
            raise OSError(errno.EINVAL, f"it is this rank's standard input, and {launcher}; "
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


#: The processes of MPI launchers that start ranks (by ``/proc/PID/comm``) and hand
#: their standard input to rank 0 alone: why a manifest cannot come that way, and the
#: variable that says the job's size where it matters only with more than one rank.
_NEVER_CLOSED = ("Open MPI forwards it to rank 0 alone and never closes it (rank 0 "
                 "would wait for the end of the manifest for ever)", None)
_DAEMONS: dict[str, tuple[str, str | None]] = {
    **dict.fromkeys(("prterun", "prted", "orted", "orterun", "mpirun", "mpiexec"),
                    _NEVER_CLOSED),
    "hydra_pmi_proxy": ("MPICH forwards it to rank 0 alone (the other ranks read nothing)",
                        "PMI_SIZE"),
}
#: The names of this process's standard input.
_STDIN_NAMES = ("/dev/stdin", "/dev/fd/0", "/proc/self/fd/0", "/proc/thread-self/fd/0")


def forwarded_stdin(path: str | os.PathLike[str], opened: os.stat_result) -> str | None:
    """Why ``path`` (opened, its stat ``opened``) cannot serve as a manifest: it names
    this process's standard input, which is not a regular file (a regular one is read
    from its start on every rank alike) and came unchanged from a launcher that gives
    it to one rank only (:func:`_giver`); else ``None``. A process fed by a shell's
    ``|`` reads it as before, a rank's own pipeline under a launcher too."""
    if stat.S_ISREG(opened.st_mode) or not _names_stdin(path):
        return None
    return _giver(opened)


def _names_stdin(path: str | os.PathLike[str]) -> bool:
    """Whether ``path``, or a symbolic link on the way from it, names standard input."""
    here, own = os.path.abspath(path), f"/proc/{os.getpid()}/fd/0"
    for _ in range(40):  # as many links as the kernel follows
        if here in _STDIN_NAMES or here == own:
            return True
        try:
            target = os.readlink(here)
        except OSError:
            return False
        here = os.path.normpath(os.path.join(os.path.dirname(here), target))
    return False


def _giver(opened: os.stat_result) -> str | None:
    """Why this process's standard input (``opened``) cannot be read whole, where it
    came unchanged from an MPI launcher's process (each process on the way up holds
    the same one), or from torchrun's agent with more than one worker on this node;
    else ``None``."""
    same = (opened.st_dev, opened.st_ino)
    for pid in ancestors()[:16]:
        if pid == 1:
            return None
        daemon = _DAEMONS.get(name(pid) or "")
        if daemon is not None:
            why, size = daemon
            return why if size is None or _more_than_one(os.environ.get(size)) else None
        try:
            theirs = os.stat(f"/proc/{pid}/fd/0")
        except OSError:  # not ours to read, or gone: not known to be the launcher's
            return None
        if (theirs.st_dev, theirs.st_ino) != same:
            return None  # a pipe made on the way (a rank's own shell pipeline)
        if "TORCHELASTIC_RUN_ID" in os.environ and _more_than_one(os.environ.get(
                "LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE"))):
            return ("torchrun's workers on this node share it (each would read part of "
                    "the manifest, or none)")
    return None


def _more_than_one(value: str | None) -> bool:
    try:
        return value is not None and int(value) > 1
    except ValueError:
        return False
