"""The watcher of PROGRAM's process group: what ends it when the wrapper is killed
outright (SIGKILL), which no code of the wrapper's can see (:mod:`launch._child`).

A ``/bin/sh`` in a session of its own, out of reach of a signal sent to the wrapper's
group, reads a pipe from the wrapper: PROGRAM's group, then, once the wrapper has dealt
with that group, a line saying so. End of file before that line means the wrapper
died, and the watcher kills the group. It costs a process of under 2 MB per rank.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

from distcache._log import get_logger

log = get_logger(__name__)

#: The watcher's script: the first line on its stdin is PROGRAM's process group; a
#: second line means the wrapper has dealt with that group (it is done); end of file
#: before it means the wrapper died, and the group is killed. Nothing is killed before
#: the group is known, nor once the wrapper is done (the group's number may be reused
#: once it is empty).
WATCHER = 'read -r group || exit 0; read -r done || kill -s KILL -- "-$group"; exit 0'
#: ``$0`` of the watcher, the name it shows in the process table.
WATCHER_NAME = "distcache-launch-watcher"


class Watcher:
    """The watcher (:data:`WATCHER`) of PROGRAM's group; a no-op where ``/bin/sh``
    cannot be started (then a wrapper killed outright leaves PROGRAM's children)."""

    def __init__(self) -> None:
        self._pipe: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._watching = False
        read, write = os.pipe()  # not inherited by PROGRAM (close_fds, non-inheritable)
        try:
            # A session of its own: a launcher's signal to the wrapper's group (torchrun
            # ends a rank by killpg) does not reach it. Its stdout and stderr are not
            # the wrapper's, which would keep the launcher's pipes open after the rank.
            self._proc = subprocess.Popen(
                ["/bin/sh", "-c", WATCHER, WATCHER_NAME], stdin=read,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                cwd="/", env={})  # pins no directory; needs no variable (kill is built in)
        except OSError as exc:
            os.close(write)
            log.debug("no watcher for PROGRAM's group (%s): a wrapper killed outright "
                      "leaves what PROGRAM started", exc)
        else:
            self._pipe = write
        finally:
            os.close(read)

    def watch(self, group: int) -> None:
        self._say(f"{group}\n")
        self._watching = True

    def done(self) -> None:
        """The group is dealt with (or was never started): the watcher exits without
        killing anything."""
        if self._watching:
            self._say("done\n")
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)  # reaped here rather than left a zombie

    def _say(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            os.write(self._pipe, line.encode())
        except OSError:  # the watcher is gone (killed): nothing watches the group now
            os.close(self._pipe)
            self._pipe = None
