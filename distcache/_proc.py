"""This host's process table, read from ``/proc``: a process's fields, its name, its
ancestors. Every reader answers ``None`` (or nothing) where ``/proc`` cannot say."""

from __future__ import annotations

import os

#: How far up the process tree :func:`ancestors` looks.
MAX_DEPTH = 64


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces
    and parentheses): state, ppid, ...; None where there is none to read."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def name(pid: int) -> str | None:
    """Process ``pid``'s name (``/proc/PID/comm``: its program's, 15 bytes at most)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as comm:
            return comm.read().decode(errors="replace").strip()
    except OSError:
        return None


def ancestors(pid: int | None = None) -> list[int]:
    """The parent, grandparent ... of ``pid`` (default: this process), from ``/proc``;
    empty where there is none to read."""
    found: list[int] = []
    here = os.getpid() if pid is None else pid
    for _ in range(MAX_DEPTH):
        fields = stat_fields(here)
        try:
            here = int(fields[1]) if fields is not None else 0
        except (ValueError, IndexError):
            break
        if here <= 0:
            break
        found.append(here)
        if here == 1:
            break
    return found
