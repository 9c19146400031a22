"""What a node agent leaves behind when its process exits without closing its
session: its key file and socket in the pool. An exit hook removes them (at a normal
exit or an uncaught error; a process a signal kills outright runs no hook). A forked
child runs no hook, and forgets the key files (:data:`KEY_FILES`): they are its
parent's, whose agent still serves, never removed by the child's close."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

#: The key file each agent ``host_agent`` started wrote: its (device, inode), so that
#: closing removes that file and never one put at its name since; emptied in a forked
#: child.
KEY_FILES: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
os.register_at_fork(after_in_child=KEY_FILES.clear)

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
