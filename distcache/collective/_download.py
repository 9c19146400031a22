"""Fetching missing artifacts from the origin: each rank downloads its share of the
plan into its own pool (:func:`download_objects`), with a few worker threads, under a
time budget, and with rules for which failures stop the other downloads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from distcache.artifact import Artifact
from distcache.errors import ArtifactNotFound, IntegrityError, OriginError, PoolError
from distcache.origins import Origin
from distcache.store import Pool


@dataclass
class Downloaded:
    """What one rank's downloads did."""

    downloads: int = 0
    origin_bytes: int = 0
    #: The first ``(artifact name, error)``, if any download failed.
    failure: tuple[str, BaseException] | None = None


def _only_this_artifact(exc: BaseException) -> bool:
    """Whether ``exc`` condemns one artifact only, not the origin or the pool."""
    return isinstance(exc, IntegrityError | ArtifactNotFound)


def download_objects(
    pool: Pool,
    origin: Origin,
    artifacts: Sequence[Artifact],
    *,
    workers: int,
    timeout: float | None = None,
    on_done: Callable[[int], None] | None = None,
) -> Downloaded:
    """Fetch ``artifacts`` from ``origin`` into ``pool`` with ``workers`` threads.

    Publication is atomic (``pool.download`` streams the verified bytes into a
    temporary file, then links it), so any rank sharing
    the pool may do this. A failure confined to one artifact (its bytes do not match
    the digest, or the origin has no such file:
    :class:`~distcache.errors.ArtifactNotFound`) does not stop the others: they are
    published, so that the next job fetches only what failed. Any other failure (the
    origin is unreachable, the pool cannot be written) stops new downloads from
    starting. The first failure is returned, not raised, so the caller can agree on it
    with its peers.

    ``timeout`` bounds the whole call: an origin can stall a download for ever while
    bounding each read (a server that sends one byte per read timeout), and the peers
    of this rank stop waiting for it after the collective's timeout anyway. A download
    still running then is abandoned to its (daemon) thread, reported as an
    :class:`~distcache.errors.OriginError`, and whatever it publishes later is whole.
    ``on_done(nbytes)`` is called after each download (for a progress bar).
    """
    result = Downloaded()
    if not artifacts:
        return result
    lock = threading.Lock()
    stop = threading.Event()
    finished = threading.Event()
    todo = list(reversed(artifacts))
    running: dict[int, str] = {}
    left = [len(artifacts)]

    def one(artifact: Artifact) -> None:
        if stop.is_set():
            return
        try:
            if pool.has(artifact.sha256):
                return  # published since discovery: a concurrent job, a resumed run
            # Streamed into the pool, verified by the origin as it streams, published
            # atomically; made durable with the rest of the batch.
            size = pool.download(artifact, origin)
            with lock:
                if not finished.is_set():
                    result.downloads += 1
                    result.origin_bytes += size
            if on_done is not None:
                on_done(size)
        except Exception as exc:
            with lock:
                if not finished.is_set():
                    result.failure = result.failure or (artifact.name, exc)
            if not _only_this_artifact(exc):
                stop.set()

    def work() -> None:
        me = threading.get_ident()
        while True:
            with lock:
                if not todo:
                    return
                artifact = todo.pop()
                running[me] = artifact.name
            one(artifact)
            with lock:
                running.pop(me, None)
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

    threads = [
        threading.Thread(target=work, name=f"distcache-fetch-{i}", daemon=True)
        for i in range(max(1, min(workers, len(artifacts))))
    ]

    def run() -> Downloaded:
        for t in threads:
            t.start()
        if finished.wait(timeout):
            for t in threads:
                t.join()
            return result
        stop.set()
        with lock:
            finished.set()  # freeze the figures: late finishers no longer count
            stalled = sorted(running.values())
            name = stalled[0] if stalled else artifacts[0].name
            if result.failure is None:
                result.failure = (
                    name,
                    OriginError(
                        f"download of {name} from {origin.describe()} did not finish within "
                        f"{timeout:g} s ({len(stalled)} still running); the origin is stalling: "
                        "check it, or raise DISTCACHE_TIMEOUT",
                        name=name,
                        timeout=timeout,
                    ),
                )
            return Downloaded(result.downloads, result.origin_bytes, result.failure)

    try:
        with pool.batch():
            return run()
    except PoolError as exc:
        # The batch's flush failed: what was published may not survive a power loss.
        return Downloaded(result.downloads, result.origin_bytes,
                          result.failure or (artifacts[0].name, exc))
