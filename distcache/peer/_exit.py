"""What a node agent leaves behind when its process exits without closing its
session: its key file and socket in the pool. An exit hook removes them (at a normal
exit or an uncaught error; a process a signal kills outright runs no hook)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

#: Each registered agent's hook, by ``id`` (the hook holds the agent, so the id stays).
_HOOKS: dict[int, Callable[[], None]] = {}


def register(agent: Any, leave: Callable[[Any], None]) -> None:
    """Call ``leave(agent)`` at this process's exit, unless :func:`unregister` first."""
    hook = functools.partial(_run, leave, agent, os.getpid())
    _HOOKS[id(agent)] = hook
    atexit.register(hook)


def unregister(agent: Any) -> None:
    """Drop ``agent``'s hook (its session closed it)."""
    hook = _HOOKS.pop(id(agent), None)
    if hook is not None:
        atexit.unregister(hook)


def _run(leave: Callable[[Any], None], agent: Any, pid: int) -> None:
    if os.getpid() != pid:  # a forked child: the agent's threads and files are not its
        return
    with contextlib.suppress(Exception):  # at exit: nothing is left to report it to
        leave(agent)
