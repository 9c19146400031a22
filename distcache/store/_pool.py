"""ArtifactPool: the content-addressed artifact store on disk.

Correctness never depends on a lock (DESIGN.md, "Artifacts and the pool"): every
read is verified, publication is write-to-unique-temp + fsync + ``link`` into place
(first publisher wins; content-addressed, so every publisher has the same bytes),
and a crash leaves either no object or a whole one.

:class:`ArtifactPool` is the one public entry point: artifacts (names, origins,
materialized files), the size cap, the pool's identity. Behind it ``layout`` names
every path and checks the format, ``_objects`` reads, publishes and quarantines,
``_log`` keeps the labels and the journal, ``_intake`` streams an origin's bytes in,
``_cap`` holds the size cap, ``_maintenance`` scans the whole pool (``gc``,
``verify``, ``stats``, ``sweep``; their reports load on first use).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.artifact import Artifact, check_sha256, sha256_hex, validate_name
from distcache.config import Settings, setting
from distcache.errors import ConfigError, IntegrityError, PoolError
from distcache.store import _maintenance
from distcache.store._cap import Cap
from distcache.store._locking import FileLock
from distcache.store._log import Journal
from distcache.store._materialize import materialize
from distcache.store._names import PLANTED_ERRNOS, UNLABELLED_ERRNOS, NamesIndex
from distcache.store._objects import Witness, check_size
from distcache.store._offline import refuse_offline
from distcache.store._opening import open_root, refusal
from distcache.store.layout import STALE_TMP_SECONDS, PoolLayout

if TYPE_CHECKING:
    from distcache.origins import Origin
    from distcache.store._report import GcReport, PoolStats, VerifyReport

logger = get_logger(__name__)


class ArtifactPool:
    """A content-addressed, verified, crash-safe store of artifact bytes.

    Args:
        root: the pool directory (created if missing).
        max_bytes: size cap; least recently used objects are collected past it.
            Default: ``DISTCACHE_POOL_MAX_BYTES``, else unlimited.
        lock_timeout: seconds to wait for another process downloading the same
            object before downloading it too. Default: ``DISTCACHE_LOCK_TIMEOUT``.
        read_only: open an existing pool of the current format to read it only:
            nothing is made, migrated, swept or stamped; every write raises PoolError.
        defaults: the settings (``init``'s), or the mapping of variables, that the values
            not given come from. Default: the process's variables (``os.environ``).

    Raises:
        PoolError: the root or layout cannot be made or is not a directory, the format is
            malformed or newer than supported (``read_only``: not current, or no pool).
        ConfigError: a negative ``max_bytes``/``lock_timeout`` or a bad variable.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None,
                 lock_timeout: float | None = None, read_only: bool = False,
                 defaults: Settings | Mapping[str, str] | None = None) -> None:
        for name, value in (("max_bytes", max_bytes), ("lock_timeout", lock_timeout)):
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value}", variable=name, value=value)
        # Only the two rows used: a bad unrelated variable cannot stop a pool.
        self.max_bytes: int | None = setting("pool_max_bytes", defaults, max_bytes)
        self.lock_timeout: float = setting("lock_timeout", defaults, lock_timeout)
        #: Every on-disk path of this pool.
        self.layout = PoolLayout(Path(root))
        self.root = self.layout.root
        #: Whether this pool object only reads (``read_only``).
        self.read_only = read_only
        opened = open_root(self.layout, read_only=read_only)
        #: The on-disk format version: :data:`~distcache.store.layout.FORMAT_VERSION` once open.
        self.format_version = opened.format_version
        self._store = opened.store(self.layout)
        self._names_index = NamesIndex(self.layout.names_log, 0o666)
        self._journal = Journal(self.layout.journal_log, 0o666)
        self._unlabelled = False  # said once: this pool cannot take labels
        #: The pool's identity: its ``pool_id``, and the probes a collective places
        #: to show which ranks see this directory (a copy takes a fresh id).
        self.identity = opened.identity(self.layout)
        self._cap = Cap(self._store, self.max_bytes)
        if not read_only:
            self.sweep()

    def __repr__(self) -> str:
        return f"ArtifactPool({str(self.root)!r}, pool_id={self.pool_id!r})"

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise refusal(self.root, what)

    @property
    def pool_id(self) -> str:
        """The pool's id (32 hex digits; see :class:`~distcache.store._identity.PoolIdentity`)."""
        return self.identity.pool_id

    @property
    def quarantined(self) -> int:
        """Objects this pool object moved to ``quarantine/`` since it was opened."""
        return self._store.quarantined

    @property
    def stamp_interval(self) -> float:
        """Reads refresh an object's recency stamp when it is older than this
        (seconds; default 60)."""
        return self._store.stamp_interval

    @stamp_interval.setter
    def stamp_interval(self, seconds: float) -> None:
        self._store.stamp_interval = seconds

    @property
    def quarantine_keep(self) -> int:
        """Quarantined entries kept, newest first, of every kind (default 16; trimmed
        on each quarantine and collection: ``quarantine/`` is outside the size cap, so a
        medium that keeps corrupting cannot fill the disk)."""
        return self._store.quarantine_keep

    @quarantine_keep.setter
    def quarantine_keep(self, count: int) -> None:
        self._store.quarantine_keep = count

    # -- reading ------------------------------------------------------------------

    def has(self, sha256: str) -> bool:
        """Whether an object for ``sha256`` is present (no hashing; a later ``get``
        may still find it corrupt). ValueError: ``sha256`` is not 64 lowercase hex."""
        return self._store.has(check_sha256(sha256))

    def holding(self, shas: Iterable[str]) -> list[bool]:
        """:meth:`has` for each of ``shas``, a fanout checked once (ValueError: a bad sha)."""
        return self._store.holding([check_sha256(s) for s in shas])

    def get(self, sha256: str, *, trust_own: bool = False) -> bytes | None:
        """The verified bytes of ``sha256``, or ``None`` when absent or corrupt.
        With ``trust_own``, an object verified in this process (this pool object
        published it, hashing it as it was written, or :meth:`vouch` took it) is
        returned unhashed while its file is this user's and unchanged (same inode,
        size, mtime and ctime).

        A corrupt object (wrong bytes, truncated, a symlink or other non-file) is
        quarantined, counted in :attr:`quarantined`, logged, and reported as a miss.

        Raises:
            ValueError: ``sha256`` is not 64 lowercase hex characters.
            PoolError: the object exists but cannot be read (permissions, I/O error).
        """
        return self._store.read(check_sha256(sha256), stamp=True, trusted=trust_own)

    def verified(self) -> dict[str, Witness]:
        """Objects verified in this process, each with its file's (device, inode,
        size, mtime ns, ctime ns) then; another process of the job on this host may
        :meth:`vouch` for them (``get(trust_own=True)`` trusts each while it matches)."""
        return self._store.verified()

    def vouch(self, verified: dict[str, Witness]) -> None:
        """Take another process's :meth:`verified` objects as verified here too."""
        self._store.vouch(verified)

    def objects(self) -> Iterator[str]:
        """The shas present (a directory scan; no hashing).

        Raises:
            PoolError: the objects directory cannot be listed.
        """
        for _path, sha, _st in self._store.scan():
            yield sha

    # -- writing ------------------------------------------------------------------

    def put(self, data: bytes | bytearray | memoryview, sha256: str | None = None) -> str:
        """Store ``data`` and return its sha256. Idempotent: an existing good object
        is kept; a corrupt one is quarantined and replaced.

        Raises:
            IntegrityError: ``sha256`` was given and ``data`` does not match it.
            ValueError: ``sha256`` is malformed.
            PoolError: the object cannot be written (or the pool is open read-only).
        """
        self._writable("store an object")
        actual = sha256_hex(data)
        if sha256 is not None and check_sha256(sha256) != actual:
            raise IntegrityError(
                f"refusing to store bytes as {sha256}: their sha256 is {actual}",
                sha256=sha256, actual=actual, source="put",
            )
        if self._store.read(actual, stamp=True) is None and self._store.write(data, actual):
            self._published(actual, len(data))
        else:  # there already (or first): in a batch's set, as what it publishes
            self._cap.held(actual, len(data))
        return actual

    def _published(self, sha: str, size: int) -> None:
        self._journal.append(sha)
        self._cap.max_bytes = self.max_bytes  # an attribute callers may set
        self._cap.published(sha, size)

    def fetch(self, artifact: Artifact, origin: Origin) -> bytes:
        """The verified bytes of ``artifact``: from the pool, else from ``origin``.

        On a miss, one process per pool downloads while the others wait (at most
        ``lock_timeout`` seconds) for its object; if the downloader dies its lock
        dies with it and the next waiter downloads. A lock that times out or does not
        work costs a duplicate download, never a corrupt object or a hang.

        Raises:
            ConfigError: a miss while ``DISTCACHE_OFFLINE=1`` (``origin`` is not asked).
            IntegrityError: the origin's bytes do not match the sha256 (or size).
            OriginError: the origin cannot deliver (passed through).
            PoolError: the pool cannot be written.
        """
        self._writable(f"fetch {artifact.name}")
        sha = artifact.sha256
        data = self._store.read(sha, stamp=True)
        if data is None:
            lock = FileLock(self.layout.lock_path(sha), timeout=self.lock_timeout,
                            remove_on_release=True)
            got = lock.acquire()
            try:
                if not got:
                    logger.warning("waited %.0fs for another download of %s; downloading it too",
                                   self.lock_timeout, artifact.name)
                else:
                    data = self._store.read(sha, stamp=True)
                if data is None:
                    refuse_offline(artifact, self.root, origin)
                    from distcache.store._intake import download_bytes  # a miss only

                    data = download_bytes(self._store, artifact, origin, self._published)
            finally:
                lock.release()
        check_size(artifact, len(data), "pool")
        self._cap.held(sha, len(data))  # a batch's set is kept whole, found or fetched
        self.label([artifact])
        return data

    def hold(self, shas: Iterable[str]) -> None:
        """Count the objects ``shas`` present in this pool as part of what the open
        batches bring (a prefetch's or a sync's set, found here or moved in by another
        process): the collection of a capped pool when the last batch ends keeps them,
        as it keeps what the batches published (without a cap or an open batch, nothing
        is kept). Held objects count as used now: a recency stamp older than
        :attr:`stamp_interval` is refreshed, as a read does (ValueError: a bad sha)."""
        self._cap.max_bytes = self.max_bytes  # an attribute callers may set
        for sha in shas:
            size = self._store.stamp(check_sha256(sha), write=not self.read_only)
            if size is not None:  # absent: nothing to keep
                self._cap.held(sha, size)

    def batch(self, *, wait: bool = True) -> AbstractContextManager[None]:
        """A context in which publications are made durable together when it ends
        (one filesystem flush, not an ``fsync`` per object and directory; with
        ``wait=False`` on a thread of its own, logging a failure); batches open at once
        on several threads of this pool object share one flush, when the last ends
        (that one waits or not as it asked, for all of them). Safe because every
        read is verified: a torn object after a power loss is quarantined and fetched.
        A capped pool collects once the last open batch ends, never what the batches
        published (:class:`~distcache.store._cap.Cap`).

        Raises:
            PoolError: (on exit, waiting, as the last open batch) the flush failed.
        """
        return self._cap.batch(self._store.batch(wait=wait))

    def download(self, artifact: Artifact, origin: Origin) -> int:
        """Stream ``artifact`` from ``origin`` into the pool, publish it, return its
        size. The origin verifies as the bytes stream in (its contract): hashed once.

        Raises:
            ConfigError: ``DISTCACHE_OFFLINE=1`` (``origin`` is not asked).
            IntegrityError: the origin's bytes do not match the sha256 (or size).
            OriginError: the origin cannot deliver (passed through).
            PoolError: the pool cannot be written.
        """
        refuse_offline(artifact, self.root, origin)
        if not hasattr(origin, "fetch_into"):  # a duck-typed origin with only ``fetch``
            data = origin.fetch(artifact)
            return len(data) if self.put(data, artifact.sha256) else 0
        from distcache.store._intake import download_streamed  # a download only

        return download_streamed(self._store, artifact, origin, self._published)

    def materialize(self, artifact: Artifact, into_dir: str | os.PathLike[str]) -> Path:
        """Place the artifact at ``into_dir/<name>`` and return that path.

        A hard link to the object when on the same filesystem, else an atomic copy.
        An existing correct target is kept; a wrong one (or a symlink) is replaced
        atomically, so any number of processes may materialize the same target.

        Raises:
            ArtifactNameError: the name is unsafe (checked before touching any file).
            IntegrityError: the object's size is not the one the artifact declares.
            PoolError: the object is not in the pool, or the target cannot be written.
        """
        self._writable(f"materialize {artifact.name}")
        target = materialize(self._store, artifact, into_dir)
        self.label([artifact])
        return target

    # -- labels and journal -------------------------------------------------------

    def remember(self, artifacts: Iterable[Artifact]) -> None:
        """Record ``name -> sha`` labels (validated first; unchanged ones are skipped);
        none where ``names.log`` is not a regular file (:data:`PLANTED_ERRNOS`), said once.

        Raises:
            ArtifactNameError: a name is unsafe (nothing is written).
            ValueError: a sha256 is malformed.
            PoolError: the index cannot be written.
        """
        self._writable("record labels")
        pairs = [(a.name, a.sha256) for a in artifacts]
        try:
            # Labels this process holds, or finds in the log on its first read, cost no
            # validation (held names were validated when recorded or read).
            if self._names_index.holds(pairs) or self._names_index.refreshed_holds(pairs):
                return
            self._names_index.record([(validate_name(n), check_sha256(s)) for n, s in pairs])
        except PoolError as exc:
            if exc.errno not in PLANTED_ERRNOS:
                raise
            for name, sha in pairs:  # an unsafe name is refused all the same
                validate_name(name)
                check_sha256(sha)
            self._say_unlabelled(exc)

    def label(self, artifacts: Iterable[Artifact]) -> None:
        """:meth:`remember` where the pool can take it; where it cannot for a reason of
        :data:`UNLABELLED_ERRNOS` (objects stay readable by sha), say so once
        (PoolError: it cannot for another reason)."""
        try:
            self.remember(artifacts)
        except PoolError as exc:
            if exc.errno not in UNLABELLED_ERRNOS:
                raise
            self._say_unlabelled(exc)

    def _say_unlabelled(self, exc: PoolError) -> None:
        """Say, once per pool object, that this pool takes no labels and why."""
        if not self._unlabelled:
            self._unlabelled = True
            logger.warning("%s; names are not recorded in this pool (its objects are "
                           "still read and verified by sha)", exc)

    def names(self) -> dict[str, str]:
        """Every recorded name and the sha it maps to, the last record winning
        (PoolError: the index cannot be read)."""
        return self._names_index.snapshot()

    def journal_since(self, cursor: int = 0) -> tuple[list[str], int]:
        """Shas published into this pool (by any process) after ``cursor``, oldest
        first and without repeats, and the cursor to pass next time (``0`` starts from
        the beginning).

        Raises:
            PoolError: the journal cannot be read.
        """
        return self._journal.since(cursor)

    # -- maintenance (distcache.store._maintenance) ----------------------------------

    def gc(self, max_bytes: int | None = None) -> GcReport:
        """Remove least recently used objects until at most ``max_bytes`` (default:
        the pool's cap; no cap removes nothing) remain (:func:`_maintenance.gc`).

        Raises:
            PoolError: the objects directory cannot be listed.
        """
        self._writable("collect objects")
        self._cap.max_bytes = self.max_bytes
        return self._cap.collect(max_bytes)

    def verify(self) -> VerifyReport:
        """Hash every object; quarantine the corrupt ones (PoolError: the pool cannot
        be listed or an object read)."""
        self._writable("verify (and quarantine) objects")
        return _maintenance.verify(self._store)

    def stats(self) -> PoolStats:
        """Counts from a directory scan, no hashing; the labels of present objects only
        (PoolError: the pool cannot be listed, or the name index read)."""
        return _maintenance.stats(self.layout, pool_id=self.pool_id, names=self.names(),
                              max_bytes=self.max_bytes)

    def sweep(self, max_age: float = STALE_TMP_SECONDS) -> int:
        """Remove stale temporary and lock files, as on every writable open; how many."""
        self._writable("sweep stale files")
        return _maintenance.sweep(self.layout, max_age)
