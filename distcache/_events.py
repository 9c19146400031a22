"""Structured events: one JSON line per event, appended to ``DISTCACHE_LOG_JSON``.

:func:`emit` is for figures a program or a dashboard reads back (prefetch reports,
loader statistics), next to the human-readable log. Each event is written with one
``write`` on a descriptor opened with ``O_APPEND``, so lines from many processes
sharing the file do not interleave on a local filesystem. Emitting never raises into
the caller: a telemetry file that cannot be written must not fail a job, so a failure
is logged once per process and the event is dropped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from distcache._log import get_logger
from distcache.config import env_str

log = get_logger(__name__)

#: The variable naming the file events are appended to; unset or blank: no events.
VARIABLE = "DISTCACHE_LOG_JSON"

# Causes already warned about: one warning per cause and file in a process, not one
# per event; process-wide like the log it goes to.
_warned: set[str] = set()


def destination(environ: Mapping[str, str] | None = None) -> str | None:
    """The file events go to, or ``None`` when ``DISTCACHE_LOG_JSON`` is unset or blank."""
    value = env_str(VARIABLE, None, environ)
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
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
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


def destination_or_none() -> str | None:
    """:func:`destination` that never raises (for messages about a failed emit)."""
    try:
        return destination()
    except Exception:
        return None
