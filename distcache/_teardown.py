"""Closing a session once, whichever thread asks.

``Session.close`` may be called from two threads at once (an engine's shutdown hook
and its main thread), from inside its own teardown (an uninstall that closes the
session), and from the background start-up's own thread (an install that gives up and
closes the session it is starting). :class:`Closing` lets the first caller tear down;
another caller waits until the teardown is over, except where the teardown waits for
that caller: the closer itself, and the start-up's thread, which the closer joins.
Once the start-up's own thread tore the session down, the start-up goes no further
(:meth:`Closing.unless_torn_down`) and leaves nothing set up behind it. A closer
interrupted while it waits for the start-up (Ctrl-C) gives the teardown up before it
begins (:meth:`Closing.reopen`): the session stays open and may be closed again.
In a child forked from the process that set the session up, the teardown uninstalls the
integrations (the child's own copies) and leaves the slot, but closes none of the parts:
the node agents, the mapped pools and the communicator are the parent's, and stopping
them there would wait for threads the child does not have, or take them from the
parent.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from distcache._log import get_logger
from distcache.errors import DistcacheError

if TYPE_CHECKING:
    from distcache._background import Background
    from distcache.integrations import Integration

log = get_logger(__name__)

#: Seconds a second ``close`` waits for the teardown when the session has no settings
#: (and so no ``DISTCACHE_TIMEOUT``) to go by.
WAIT_S = 600.0


class Closable(Protocol):
    """A part of a session that ``close`` closes (the communicator, the registry...)."""

    def close(self) -> object: ...


class Closing:
    """Whether a session is closed, who tears it down, and when that is over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._over = threading.Event()
        self._closer: threading.Thread | None = None
        self._pid = os.getpid()  # the process whose parts tear_down closes
        self.closed = False
        # How many of the session's integrations the teardown uninstalls (None until it
        # runs); any installed after that were installed by a start-up it did not join.
        self.taken: int | None = None

    def claim(self, start_up: threading.Thread | None, timeout: float | None) -> bool:
        """Whether the calling thread is to tear the session down: true for the first
        caller only. A later one returns at once when the teardown is over, or runs on
        its thread, or is the ``start_up`` thread (which the teardown joins); else it
        waits until it is over, at most ``timeout`` seconds, and then returns (with a
        warning) rather than wait for ever. Where the first caller gave the teardown up
        before it began (:meth:`reopen`), a waiting caller claims it in its place."""
        me = threading.current_thread()
        while True:
            with self._lock:
                if not self.closed:
                    self.closed, self._closer = True, me
                    return True
                closer, over = self._closer, self._over
            if me is closer or me is start_up:
                return False
            bound = WAIT_S if timeout is None else timeout
            if not over.wait(bound):
                log.warning("close: the teardown on thread %r is still running after %g "
                            "s; returning without it", closer and closer.name, bound)
                return False
            with self._lock:
                if self.closed:
                    return False

    def reopen(self) -> None:
        """Give the teardown up before it began (the closer was interrupted while it
        waited for the start-up): the session is open again, and ``close`` may be
        called again; a caller waiting in :meth:`claim` claims the teardown itself."""
        with self._lock:
            self.closed, self._closer = False, None
            over, self._over = self._over, threading.Event()
        over.set()

    def join(self, start_up: Background | None) -> None:
        """Wait for the background ``start_up`` before the teardown, unless the caller
        is its thread or another process (where it does not run). A caller interrupted
        while it waits gives the teardown up (:meth:`reopen`) and raises. A failure of
        the start-up that no ``Session.wait`` raised is logged."""
        if start_up is None or start_up.here or start_up.elsewhere:
            return
        try:  # every collective of the start-up is bounded by the timeout
            stopped = start_up.cancel()  # closed before it ended: its downloads stop
            start_up.wait(None)
        except BaseException:
            self.reopen()  # nothing was torn down yet
            raise
        error = start_up.unreported()  # not logged again at the exit
        if stopped and start_up.error is not None:
            log.info("the background start-up ended as it was stopped: %s", start_up.error)
        elif error is not None:
            log.warning("the background start-up failed and no wait() raised it: %s", error)

    @contextlib.contextmanager
    def tearing_down(self) -> Iterator[None]:
        """The block of the caller :meth:`claim` chose; when it ends, however it ends,
        the callers waiting in :meth:`claim` return (or claim the teardown, where the
        block gave it up)."""
        over = self._over
        try:
            yield
        finally:
            over.set()

    def tear_down(self, integrations: Sequence[Integration],
                  abandon: Callable[[], object] | None, parts: Sequence[Closable | None],
                  leave: Callable[[], object] | None) -> None:
        """Undo the set-up, last done first, each step even where one fails (the error
        of the last failing step is raised, the others chained to it): uninstall the
        ``integrations`` (last installed first), ``abandon`` the node agents' start,
        close the ``parts`` in order, ``leave`` the slot. In a forked child neither
        ``abandon`` nor the ``parts``: they are the parent's."""
        self.taken = len(integrations)
        steps: list[Callable[[], object]] = [i.uninstall for i in reversed(integrations)]
        if os.getpid() != self._pid:
            log.debug("close in a child forked from process %d: its node agents, pools "
                      "and communicator are left to it", self._pid)
            abandon, parts = None, ()
        if abandon is not None:
            steps.append(abandon)
        steps += [part.close for part in parts if part is not None]
        if leave is not None:
            steps.append(leave)
        run_steps(steps)

    @property
    def torn_down(self) -> bool:
        """Whether the teardown has run (or is running) and will not run again."""
        return self.taken is not None

    def unless_torn_down(self, integrations: list[Integration],
                         note: Callable[..., None]) -> Callable[..., None]:
        """``note``, which the start-up calls after each install, preceded by a check:
        once the session was torn down on the start-up's own thread (a teardown on
        another thread joins the start-up first), it uninstalls and drops the
        integrations appended to ``integrations`` since, so that the closed session
        keeps nothing, and raises a ``DistcacheError`` that ends the start-up (and that
        ``Session.wait`` raises)."""
        def checked(*line: object) -> None:
            if self.taken is not None:
                late = integrations[self.taken:]
                del integrations[self.taken:]
                for integration in reversed(late):
                    try:
                        integration.uninstall()
                    except Exception as exc:  # the start-up's error is the one raised
                        log.warning("%s: not uninstalled: %s", integration.name, exc)
                raise DistcacheError("this distcache session was closed during its start-up")
            note(*line)

        return checked


def run_steps(steps: Sequence[Callable[[], object]]) -> None:
    """Run each of ``steps`` in order, even where one fails; the error of the last
    failing step is raised, the errors before it chained to it."""
    with contextlib.ExitStack() as stack:  # runs last-pushed first
        for step in reversed(steps):
            stack.callback(step)
