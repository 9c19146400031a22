"""Fetching missing artifacts from the origin: each rank downloads its share of the
plan into its own pool (:class:`Downloads`), with a few worker threads, with rules for
which failures stop the other downloads, and a clock of the last progress (a byte
arriving, an artifact published) that tells a slow origin from a stalled one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO, cast

from distcache.artifact import Artifact
from distcache.errors import (
    ArtifactNotFound,
    ConfigError,
    IntegrityError,
    OriginError,
    PoolError,
)
from distcache.origins import Interrupted, Origin
from distcache.store import Pool


class Downloaded:
    """What one rank's downloads did."""

    __slots__ = ("downloads", "failure", "origin_bytes", "placed")

    def __init__(self, downloads: int = 0, origin_bytes: int = 0,
                 failure: tuple[str, BaseException] | None = None, placed: int = 0) -> None:
        self.downloads = downloads
        self.origin_bytes = origin_bytes
        #: The first ``(artifact name, error)``, if any download failed.
        self.failure = failure
        #: Downloads skipped because the pool got the object meanwhile (another job
        #: published it after the plan looked): in the pool all the same.
        self.placed = placed

    def __repr__(self) -> str:
        return (f"Downloaded(downloads={self.downloads}, origin_bytes={self.origin_bytes}, "
                f"failure={self.failure!r}, placed={self.placed})")


def _only_this_artifact(exc: BaseException) -> bool:
    """Whether ``exc`` condemns one artifact only, not the origin or the pool."""
    return isinstance(exc, IntegrityError | ArtifactNotFound)


class _Ticking:
    """A file the origin streams into that notes each write as progress, and refuses
    every write once ``abandoned`` is set."""

    def __init__(self, out: BinaryIO, tick: Callable[[], None],
                 abandoned: threading.Event) -> None:
        self._out = out
        self._tick = tick
        self._abandoned = abandoned

    def write(self, data: Any) -> int:
        if self._abandoned.is_set():  # the caller gave up: fail, and the store removes
            raise Interrupted("download abandoned: the caller stopped waiting for it")
        written = self._out.write(data)
        if len(data):  # bytes came: an empty write (an origin's check of the stop) is none
            self._tick()
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


class _Watched:
    """``origin``, with every byte it streams into the pool counted as progress, and
    each of its downloads failing at its next write once ``abandoned`` is set."""

    def __init__(self, origin: Origin, tick: Callable[[], None],
                 abandoned: threading.Event) -> None:
        self._origin = origin
        self._tick = tick
        self._abandoned = abandoned

    def describe(self) -> str:
        return self._origin.describe()

    def fetch(self, artifact: Artifact) -> bytes:
        return self._origin.fetch(artifact)

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        return self._origin.fetch_into(
            artifact, cast(BinaryIO, _Ticking(out, self._tick, self._abandoned)))


class Pending:
    """The objects a rank's pool is still getting from the downloads (published or
    failed: settled), for a move that sends each as it lands (``move_objects``'s
    ``arrivals``)."""

    def __init__(self, shas: Iterable[str]) -> None:
        self._left = set(shas)
        self._landed: list[str] = []  # settled one by one, in that order
        self._over = False
        self._cond = threading.Condition()

    def settle(self, sha: str | None = None) -> None:
        """``sha`` is settled (``None``: every object, the downloads are over)."""
        with self._cond:
            if sha is None:
                self._left.clear()
                self._over = True
            elif sha in self._left:
                self._left.discard(sha)
                self._landed.append(sha)
            self._cond.notify_all()

    def waiting(self, sha: str) -> bool:
        with self._cond:
            return sha in self._left

    def landed(self, since: int, seconds: float) -> tuple[list[str], bool]:
        with self._cond:
            self._cond.wait_for(lambda: len(self._landed) > since or self._over, seconds)
            return self._landed[since:], self._over


class Downloads:
    """One rank's downloads of ``artifacts`` from ``origin`` into ``pool``, on
    ``workers`` daemon threads that :meth:`start` starts (constructing starts nothing):
    call it inside the ``pool.batch()`` that the downloads belong to, as an object found
    present is held for a capped pool's collection only while a batch is open.

    Publication is atomic (``pool.download`` streams the verified bytes into a
    temporary file, then links it), so any rank sharing the pool may do this. A
    failure confined to one artifact (its bytes do not match the digest, or the origin
    has no such file: :class:`~distcache.errors.ArtifactNotFound`) does not stop the
    others: they are published, so that the next job fetches only what failed. Any
    other failure (the origin is unreachable, the pool cannot be written) stops new
    downloads from starting. The first failure is returned by :meth:`result`, not
    raised, so the caller can agree on it with its peers.

    Nothing here bounds the time the downloads take: :meth:`idle` says how long ago
    the last byte arrived or the last artifact was published, and the caller decides
    when that is a stall (an origin can hold a download for ever while answering each
    read in time). :meth:`abandon` stops what still runs at its next write (the store
    removes its temporary file; a download blocked in a read ends when the read does);
    an origin without ``fetch_into`` is left to finish, and whatever it publishes later
    is whole. ``on_done(nbytes)`` is called after each download, and
    for each artifact skipped because the pool holds it by then (for a progress bar,
    with its listed size); ``pending`` learns each artifact settled (the caller settles the
    rest when it stops waiting).
    """

    def __init__(self, pool: Pool, origin: Origin, artifacts: Sequence[Artifact], *,
                 workers: int, on_done: Callable[[int], None] | None = None,
                 pending: Pending | None = None) -> None:
        self._pool = pool
        self._pending = pending
        self._label = origin.describe()
        self._stop = threading.Event()
        self._abandoned = threading.Event()
        self._origin: Origin = (_Watched(origin, self._tick, self._abandoned)
                                if hasattr(origin, "fetch_into") else origin)
        self._on_done = on_done
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._todo = list(reversed(artifacts))
        self._running: dict[int, str] = {}
        self._left = len(artifacts)
        self._result = Downloaded()
        self._last = time.monotonic()
        self._workers = max(1, min(workers, len(artifacts))) if artifacts else 0
        self._started = False
        self._fatal = False
        if not artifacts:
            self._finished.set()

    def start(self) -> Downloads:
        """Start the worker threads, inside the pool's open batch; returns ``self``.

        Raises:
            RuntimeError: they were started already.
        """
        with self._lock:
            if self._started:
                raise RuntimeError("these downloads were started already")
            self._started = True
        self._last = time.monotonic()
        for i in range(self._workers):
            threading.Thread(target=self._work, name=f"distcache-fetch-{i}", daemon=True).start()
        return self

    @property
    def origin(self) -> str:
        """The origin's label."""
        return self._label

    def _tick(self) -> None:
        self._last = time.monotonic()

    def wait(self, timeout: float | None) -> bool:
        """Whether every download ended, waiting at most ``timeout`` seconds."""
        return self._finished.wait(timeout)

    def idle(self) -> float:
        """Seconds since the last progress (since the start, before any)."""
        return max(0.0, time.monotonic() - self._last)

    def fatal(self) -> bool:
        """Whether a failure other than one artifact's stopped new downloads (the
        origin or the pool failed): what still runs is in vain for this call."""
        with self._lock:
            return self._fatal

    def running(self) -> list[str]:
        """The artifacts being downloaded now, sorted."""
        with self._lock:
            return sorted(self._running.values())

    def result(self) -> Downloaded:
        """What the downloads did (final once :meth:`wait` returned ``True``)."""
        with self._lock:
            got = self._result
            return Downloaded(got.downloads, got.origin_bytes, got.failure, got.placed)

    def abandon(self) -> Downloaded:
        """Start nothing more, stop the running downloads at their next write, freeze
        the figures (late finishers no longer count), and return them."""
        self._stop.set()
        self._abandoned.set()
        with self._lock:
            self._finished.set()
            got = self._result
            return Downloaded(got.downloads, got.origin_bytes, got.failure, got.placed)

    def _one(self, artifact: Artifact) -> None:
        if self._stop.is_set():
            return
        try:
            if self._pool.has(artifact.sha256):
                # Published since discovery (a concurrent job, a resumed run): nothing
                # to download, but what the progress bar counted on is here, and it is
                # this run's as if downloaded (a capped pool's collection keeps it).
                self._pool.hold([artifact.sha256])
                with self._lock:
                    if not self._finished.is_set():
                        self._result.placed += 1
                if self._on_done is not None:
                    self._on_done(artifact.size or 0)
                return
            # Streamed into the pool, verified by the origin as it streams, published
            # atomically; made durable with the rest of the batch.
            size = self._pool.download(artifact, self._origin)
            self._tick()
            with self._lock:
                if not self._finished.is_set():
                    self._result.downloads += 1
                    self._result.origin_bytes += size
            if self._on_done is not None:
                self._on_done(size)
        except BaseException as exc:
            # Whatever ends the download (an origin's library calling sys.exit, an
            # interrupt raised in it) is this rank's failure: a thread that died of it
            # would leave its artifact unsettled and the job waiting for it.
            with self._lock:
                if not self._finished.is_set():
                    self._result.failure = self._result.failure or (artifact.name, exc)
            if not _only_this_artifact(exc):
                with self._lock:
                    self._fatal = True
                self._stop.set()

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            with self._lock:
                if not self._todo:
                    return
                artifact = self._todo.pop()
                self._running[me] = artifact.name
            try:
                self._one(artifact)
            finally:
                if self._pending is not None:
                    self._pending.settle(artifact.sha256)
                with self._lock:
                    self._running.pop(me, None)
                    self._left -= 1
                    if self._left == 0:
                        self._finished.set()


def offline_refusal(artifacts: Sequence[Artifact]) -> ConfigError:
    """The error of a rank whose share of a plan is ``artifacts`` while
    ``DISTCACHE_OFFLINE=1`` forbids downloads."""
    shown = ", ".join(a.name for a in artifacts[:3])
    more = f" and {len(artifacts) - 3} more" if len(artifacts) > 3 else ""
    return ConfigError(
        f"{len(artifacts)} artifact(s) are in no pool and DISTCACHE_OFFLINE=1 forbids "
        f"downloads: {shown}{more}; import them with 'distcache pool import' or "
        "unset DISTCACHE_OFFLINE", variable="DISTCACHE_OFFLINE", value="1")


def stall_message(name: str, origin: str, timeout: float, idle: float, where: str) -> str:
    """What a download that made no progress for ``timeout`` seconds is reported as."""
    return (f"download of {name} from {origin} did not finish within {timeout:g} s of its "
            f"last progress: {where} received no byte and published nothing for {idle:.1f} s; "
            "the origin is stalling: check it, or raise DISTCACHE_TIMEOUT")


def download_objects(
    pool: Pool,
    origin: Origin,
    artifacts: Sequence[Artifact],
    *,
    workers: int,
    timeout: float | None = None,
    on_done: Callable[[int], None] | None = None,
) -> Downloaded:
    """:class:`Downloads` of ``artifacts``, waited for in one pool batch. ``timeout``
    bounds the time without progress, not the whole call: a download that received no
    byte for that long is reported as an :class:`~distcache.errors.OriginError` and
    abandoned."""
    beat = 1.0 if timeout is None else min(1.0, timeout / 4)
    downloads: Downloads | None = None
    try:
        with pool.batch():
            # Started inside the batch: an object found present is held for the batch's
            # collection only while one is open (a capped pool would collect it).
            downloads = Downloads(pool, origin, artifacts, workers=workers,
                                  on_done=on_done).start()
            while not downloads.wait(beat):
                if timeout is not None and downloads.idle() >= timeout:
                    idle, stalled = downloads.idle(), downloads.running()
                    got = downloads.abandon()
                    name = stalled[0] if stalled else artifacts[0].name
                    return Downloaded(got.downloads, got.origin_bytes, got.failure or (
                        name, OriginError(stall_message(name, downloads.origin, timeout, idle,
                                                        "this process"),
                                          name=name, timeout=timeout)), got.placed)
            return downloads.result()
    except PoolError as exc:
        if downloads is None:  # the batch could not begin: nothing was started
            return Downloaded(0, 0, (artifacts[0].name if artifacts else "", exc), 0)
        # The batch's flush failed: what was published may not survive a power loss.
        got = downloads.result()
        return Downloaded(got.downloads, got.origin_bytes,
                          got.failure or (artifacts[0].name, exc), got.placed)
