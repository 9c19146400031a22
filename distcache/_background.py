"""A session's start-up run on a thread of its own (``init(background=True)``).

:class:`Background` tells that the start-up is over by an event its body sets as it
ends, never by whether its thread is alive (a join that a Ctrl-C interrupted may leave
a running thread looking ended), keeps what the body raised for ``Session.wait``, and
knows the process that started it: a process forked while it ran has no such thread,
so there ``wait`` and ``ready`` raise instead of taking it for over.

The start-up's thread runs in a copy of the context of the ``init`` that started it,
so that an ``init`` called from inside the start-up (an integration's install) finds
the session being started (``distcache.session``'s ``STARTING``).
"""

from __future__ import annotations

import atexit
import contextvars
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.comm import tell_others
from distcache.errors import CollectiveTimeout, DistcacheError

if TYPE_CHECKING:
    from distcache.comm import Communicator

log = get_logger(__name__)

class Background:
    """The start-up ``body`` on a thread :meth:`start` starts (in a copy of the
    caller's context); what it raised, told to the other ranks of ``comm``."""

    def __init__(self, body: Callable[[], None], comm: Communicator,
                 stop: Callable[[Sequence[threading.Thread]], None] | None = None) -> None:
        self.thread = threading.Thread(target=contextvars.copy_context().run,
                                       args=(self._run, body), daemon=True,
                                       name="distcache-start-up")
        self.error: BaseException | None = None
        # Where it was raised: each wait raises it from there, not from the last wait.
        self._trace: TracebackType | None = None
        self.waited = False  # wait() raised self.error, or it was logged (unreported)
        self._comm = comm
        self._over = threading.Event()
        self._pid = os.getpid()
        # Stops the start-up's downloads and removes their temporary files, given the
        # threads to wait for a moment first (Stopper.interrupt).
        self._stop = stop
        _STARTED.add(self)

    def start(self) -> None:
        try:
            self.thread.start()
        except BaseException:
            self._over.set()  # it never ran: nothing waits for it
            raise

    def _run(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:
            self.error, self._trace = exc, exc.__traceback__
            tell_others(self._comm, exc)
            log.debug("background start-up failed: %s", exc)
        finally:
            self._over.set()

    def cancel(self) -> bool:
        """Stop the downloads of a start-up that is not over (a close before it ended,
        the process's exit): each fails at its next write, and the start-up with it,
        told to the other ranks as any failure is; the temporary files of those still
        running are removed. Not in a forked child (:attr:`elsewhere`). Whether it was
        stopped."""
        if self._stop is None or self._over.is_set() or self.elsewhere:
            return False
        log.info("the background start-up is stopped before it ended: its downloads stop "
                 "and their temporary files are removed")
        self._stop(() if self.here else (self.thread,))
        return True

    @property
    def elsewhere(self) -> bool:
        """Whether this is a child forked while the start-up ran: another process than
        the one that started it, where it was not over at the fork (and never will be).
        A child forked after it was over has its outcome, as after a foreground one."""
        return os.getpid() != self._pid and not self._over.is_set()

    @property
    def here(self) -> bool:
        """Whether the caller is the start-up's own thread."""
        return threading.current_thread() is self.thread

    @property
    def failed(self) -> bool:
        """Whether the start-up is over and raised (in the process that started it)."""
        return not self.elsewhere and self._over.is_set() and self.error is not None

    def wait(self, timeout: float | None) -> bool:
        """Whether the start-up is over, after waiting at most ``timeout`` seconds
        (``None``: until it is).

        Raises:
            DistcacheError: the caller is another process (a forked child), where the
                start-up's thread does not run.
        """
        if self.elsewhere:
            raise DistcacheError(
                f"the background start-up of this distcache session belongs to the parent "
                f"process {self._pid}, not to this process {os.getpid()} (forked while it "
                "ran): its thread does not run here, and its report is not this process's")
        return self._over.wait(timeout)

    def join(self, timeout: float | None, comm: Communicator) -> None:
        """Wait at most ``timeout`` seconds (``None``: no limit) for the start-up of
        this rank of ``comm``, then raise what it raised (``Session.wait``).

        Raises:
            CollectiveTimeout: the start-up is still running after ``timeout`` seconds.
            ConfigError: ``timeout`` is no number of seconds from 0 up (``inf``: no limit).
            DistcacheError: the caller is another process (:meth:`wait`).
            BaseException: what the start-up raised.
        """
        if timeout is not None:
            timeout = _seconds(timeout)
        if not self.wait(timeout):
            raise CollectiveTimeout(
                f"rank {comm.rank}/{comm.size}: the background start-up is still running "
                f"after {timeout:g} s", op="wait", timeout=timeout, rank=comm.rank)
        if self.error is not None:
            self.waited = True
            raise self.error.with_traceback(self._trace)

    def unreported(self) -> BaseException | None:
        """What the start-up raised, where it is over and neither a :meth:`join`
        raised it nor an earlier call returned it; the caller logs it, and it counts as
        reported from then on."""
        if self.error is None or self.waited or not self._over.is_set():
            return None
        self.waited = True
        return self.error


def _seconds(timeout: object) -> float | None:
    """A wait's ``timeout`` in seconds, as :func:`~distcache.config.check_seconds`
    takes one, but 0 polls and ``inf`` (or more than the longest setting) waits as
    ``None`` does.

    Raises:
        ConfigError: not a number, or NaN, or below 0.
    """
    from distcache.config import MAX_SECONDS, check_seconds

    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and (
            timeout == 0 or timeout > MAX_SECONDS):
        return None if timeout else 0.0
    return check_seconds(timeout, what="wait's timeout", text=False)


#: The background start-ups of this process, for :func:`_cancel_at_exit`.
_STARTED: weakref.WeakSet[Background] = weakref.WeakSet()


@atexit.register
def _cancel_at_exit() -> None:
    """At the interpreter's exit, stop the downloads of a background start-up still
    running (a program that exits, or is interrupted, without ``close``): its daemon
    threads would be cut off mid-write and leave their temporary files in the pool.
    A start-up of this process that failed where nothing raised or logged its error (no
    ``wait``, no ``close``) has it logged now, not lost."""
    for start_up in list(_STARTED):
        try:
            error = start_up.unreported() if start_up._pid == os.getpid() else None
            if error is not None:
                log.warning("the background start-up failed and no wait() or close() "
                            "raised or logged it: %s", error)
            start_up.cancel()
        except Exception as exc:  # the exit goes on
            log.debug("could not stop a background start-up at exit: %s", exc)
