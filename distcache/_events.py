"""Structured events: one JSON line per event, appended to ``DISTCACHE_LOG_JSON``.

:func:`emit` is for figures a program or a dashboard reads back (prefetch reports,
loader statistics), next to the human-readable log. Each event is written with one
``write`` on a descriptor opened with ``O_APPEND``, so lines from many processes
sharing the file do not interleave on a local filesystem. Emitting never raises into
the caller: a telemetry file that cannot be written must not fail a job, so a failure
is logged once per process and the event is dropped.

Only a regular file of this user is written: the open neither blocks (a FIFO nobody
reads would hang the job) nor follows a symbolic link (which could point at any file
the process may write), and a FIFO, device or another user's file is refused once
open. A file the open creates is ``0600``, less the umask.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping
from typing import Any

from distcache._log import get_logger

log = get_logger(__name__)

#: The variable naming the file events are appended to; unset or blank: no events.
VARIABLE = "DISTCACHE_LOG_JSON"

_OPEN_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
               | os.O_NOFOLLOW | os.O_NOCTTY)

# Causes already warned about: one warning per cause and file in a process, not one
# per event; process-wide like the log it goes to.
_warned: set[str] = set()


def destination(environ: Mapping[str, str] | None = None) -> str | None:
    """The file events go to, or ``None`` when ``DISTCACHE_LOG_JSON`` is unset or blank."""
    value = (os.environ if environ is None else environ).get(VARIABLE)
    return None if value is None or value.strip() == "" else value


def emit(event: str, /, **fields: Any) -> bool:
    """Append one JSON line ``{"ts", "event", "pid", "host", **fields}``.

    Values that JSON cannot represent are written as their ``str``. Returns whether a
    line was written (``False`` when no file is configured or writing failed); never
    raises.
    """
    try:
        path = destination()
        if path is None:
            return False
        import json  # loaded by the processes that write events

        record = {"ts": round(time.time(), 6), "event": event, "pid": os.getpid(),
                  "host": os.uname().nodename, **fields}
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        fd = os.open(path, _OPEN_FLAGS, 0o600)
        try:
            _check_own_regular_file(fd)
            os.write(fd, line)
        finally:
            os.close(fd)
        return True
    except Exception as exc:  # telemetry never fails the caller
        key = f"{type(exc).__name__}:{destination_or_none()}"
        if key not in _warned:
            _warned.add(key)
            log.warning("cannot write event %r to %s=%s: %s; events are dropped",
                        event, VARIABLE, destination_or_none(), exc)
        return False


def _check_own_regular_file(fd: int) -> None:
    """Refuse an open events file that is not a regular file owned by this user.

    Raises:
        OSError: it is not.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise OSError(f"not a regular file (mode {stat.filemode(info.st_mode)})")
    if info.st_uid != os.geteuid():
        raise OSError(f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")


def destination_or_none() -> str | None:
    """:func:`destination` that never raises (for messages about a failed emit)."""
    try:
        return destination()
    except Exception:
        return None
