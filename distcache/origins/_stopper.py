"""An origin whose downloads can be stopped at once (:class:`Stopper`).

Downloads run on worker threads, and Python delivers SIGINT to the main thread only:
without help an interrupted command or start-up leaves every running download to
finish (and publish), and a download it abandons leaves its partial temporary file in
the pool's ``tmp/`` until the stale sweep. :class:`Stopper` wraps the origin the
workers download from. Once :meth:`Stopper.stop` is called, every write into a
temporary file raises :class:`Interrupted`, so each running download fails at its next
chunk and the store removes its temporary file as it does for any failed download; a
download blocked in a socket read is not waited for: the caller may remove its
temporary file itself (:meth:`Stopper.remove_temp_files` knows the file by inode,
recorded when the download started).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

from distcache.artifact import Artifact
from distcache.origins._base import Origin

#: How long an interrupted command waits for its workers to notice before it removes
#: what they left and exits (a download in a socket read is not waited for).
GRACE_SECONDS = 0.1


class Interrupted(Exception):
    """A download stopped because its command was interrupted."""


class _StopWriter:
    """The temporary file an origin writes into: every write first checks the stop."""

    def __init__(self, raw: BinaryIO, stopped: threading.Event) -> None:
        self.raw = raw
        self._stopped = stopped

    def write(self, data: Any) -> int:
        if self._stopped.is_set():
            raise Interrupted("interrupted")
        return self.raw.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class Stopper:
    """Wraps ``origin`` so that the downloads using :attr:`origin` can be stopped."""

    def __init__(self, origin: Origin) -> None:
        self._origin = origin
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[int, tuple[int, int]] = {}
        self.origin: Origin = _StoppableOrigin(self)

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Make every running and later download fail at its next write."""
        self._stopped.set()

    def remove_temp_files(self, directory: str | os.PathLike[str]) -> int:
        """Remove the files in ``directory`` (the pool's ``tmp/``) that running
        downloads are writing; returns how many were removed."""
        with self._lock:
            running = set(self._running.values())
        removed = 0
        if not running:
            return removed
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if (st.st_dev, st.st_ino) in running:
                        os.unlink(entry.path)
                        removed += 1
        return removed

    def interrupt(self, tmp: str | os.PathLike[str], threads: Sequence[threading.Thread]) -> None:
        """At Ctrl-C: stop the downloads, give ``threads`` :data:`GRACE_SECONDS` to
        finish (each removes its own temporary file), then remove what is left."""
        self.stop()
        deadline = time.monotonic() + GRACE_SECONDS
        try:
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        finally:  # a second Ctrl-C (or a TERM) in the wait still leaves no temporary file
            with _ending_signals_ignored():
                self.remove_temp_files(tmp)

    def _fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        if self._stopped.is_set():
            raise Interrupted("interrupted")
        key = threading.get_ident()
        try:
            st = os.fstat(out.fileno())
        except (OSError, AttributeError, io.UnsupportedOperation):
            st = None
        if st is not None:
            with self._lock:
                self._running[key] = (st.st_dev, st.st_ino)
        try:
            return self._origin.fetch_into(artifact, _StopWriter(out, self._stopped))  # type: ignore[arg-type]
        finally:
            with self._lock:
                self._running.pop(key, None)


class _StoppableOrigin:
    """The origin a :class:`Stopper` hands out; anything else is the wrapped one's."""

    def __init__(self, stopper: Stopper) -> None:
        self._stopper = stopper

    def describe(self) -> str:
        return self._stopper._origin.describe()

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        return self._stopper._fetch_into(artifact, out)

    def fetch(self, artifact: Artifact) -> bytes:
        buffer = io.BytesIO()
        self.fetch_into(artifact, buffer)
        return buffer.getvalue()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stopper._origin, name)


@contextlib.contextmanager
def _ending_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block, on the main thread (elsewhere it cannot
    change handlers): the command is ending already, and its clean-up is short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
