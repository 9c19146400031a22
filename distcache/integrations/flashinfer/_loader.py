"""The loader wrapper: a drop-in for FlashInfer's ``get_artifact`` backed by a pool.

Policy only; :mod:`distcache.integrations.flashinfer._install` puts it into FlashInfer.
distcache's own failures never raise (its caller may be FlashInfer's ctypes callback,
which an exception cannot cross): FlashInfer's own function answers instead. What
FlashInfer's own function raises passes through unchanged.

A pool miss asks the peer tier first (:func:`distcache.peer.lookup`: this node's
agent, which asks the artifact's owner node; bounded by ``LOOKUP_BOUND_S``, never
raising), then the origin. Three answers are final and FlashInfer's function is not
asked: a name the origin FlashInfer itself would use says it does not have, bytes from
that origin that do not match the sha256 (FlashInfer would download the same bytes and
reject them), and, with ``DISTCACHE_OFFLINE=1``, a miss while FlashInfer's download
cannot be switched off.

Only FlashInfer's function answers while ``FLASHINFER_CUBIN_CHECKSUM_DISABLED`` is set
(it then returns the file in its cubin directory whatever its sha256), and for names
the pool cannot store, or outside the pooled families, but that stay inside a
directory (``pin/./a.cubin``). A name that could leave the directory (an absolute
path, a ``..`` segment) gets ``b""``. When the install moved ``FLASHINFER_CUBIN_DIR``
away from an installed ``flashinfer-cubin``, the installed file is read first, and
what such a call returns is also kept at ``FLASHINFER_CUBIN_DIR/<name>``: FlashInfer's
path readers open that file right after asking for the name.

A verified download is never thrown away: when the pool cannot take it, the caller
gets the bytes, the failure is logged once per pool, and FlashInfer's function is not
asked to download them again. Nor are verified bytes that cannot be written under
``FLASHINFER_CUBIN_DIR`` (read-only, full, a symlinked directory refused): the caller
gets them and the failure is logged once per name, not counted as a fallback.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distcache import _events, peer
from distcache._log import get_logger
from distcache.artifact import Artifact, check_sha256, path_under, sha256_hex, validate_name
from distcache.errors import ArtifactNameError, ArtifactNotFound, IntegrityError, PoolError
from distcache.integrations.flashinfer._families import Families
from distcache.integrations.flashinfer._files import (
    Keeping,
    cubin_bytes,
    hold,
    placed,
    write_replacing,
)
from distcache.integrations.flashinfer._record import Recorder
from distcache.integrations.flashinfer._seeds import escape as _escape
from distcache.integrations.flashinfer._seeds import seed_bytes
from distcache.integrations.flashinfer._upstream import (
    REPOSITORY_VARIABLE,
    checksum_disabled,
    default_origin,
    is_installed_location,
    loader_attr,
    no_download,
    repository,
)

if TYPE_CHECKING:
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = get_logger(__name__)


class LoaderStats:
    """What the loader did in this process (for logs and tests)."""

    def __init__(self) -> None:
        self.hits = 0  #: served from the pool (also after waiting for another download)
        self.local = 0  #: found valid in FLASHINFER_CUBIN_DIR and added to the pool
        self.fetched = 0  #: fetched from the origin by this process (or the owner's agent)
        self.peer = 0  #: copied from another node's agent (the artifact's owner)
        self.peer_fallbacks = 0  #: the node's agent asked the origin: no owner answered
        self.peer_failed = 0  #: the peer tier did not serve in its bound; the origin then
        self.passthrough = 0  #: not a pooled family: FlashInfer's own function
        self.fallbacks = 0  #: distcache failed; FlashInfer's own function answered
        self.rejected = 0  #: a name that could leave the directory: ``b""``, nothing touched
        self.offline_misses = 0  #: DISTCACHE_OFFLINE and not in the pool
        self.not_found = 0  #: FlashInfer's own origin has no such artifact: final
        self.mismatched = 0  #: FlashInfer's own origin sent other bytes than the sha256: final
        self.unpublished = 0  #: downloaded and served, but the pool could not take it
        self.failures: dict[str, str] = {}  #: name -> first reason

    def as_dict(self) -> dict[str, Any]:  # every counter, and a copy of the failures
        return {**vars(self), "failures": dict(self.failures)}


GetArtifact = Callable[..., bytes]

#: ``_load``'s answer when FlashInfer's own function is to answer instead.
_ASK_FLASHINFER = object()


def fetch_hint(artifact: Artifact) -> str:
    """The commands that bring ``artifact`` into an offline pool: fetched on a connected
    machine from FlashInfer's repository (named where known here), exported alone.
    The name and the URL are quoted for the shell: a name may hold a space, a quote
    or ``$(``, and the recipe is pasted as printed."""
    from distcache._urls import redact_url

    repo = repository() or str(loader_attr(REPOSITORY_VARIABLE) or "")
    origin = shlex.quote(redact_url(repo)) if repo else "URL"
    return (f"on a connected machine run: printf '%s  %s\\n' {artifact.sha256} "
            f"{shlex.quote(artifact.name)} > need.txt && distcache fetch --manifest need.txt "
            f"--origin {origin} && distcache pool export --manifest "
            "need.txt --tar need.tar; then here: distcache pool import need.tar")


class PooledLoader:
    """A drop-in ``get_artifact(file_name, sha256, session=None) -> bytes``.

    Args:
        pool: the artifact pool. original: FlashInfer's function (the fallback).
        origin: where a pool miss is fetched from (after the peer tier); ``None``:
            :func:`default_origin` at call time.
        cubin_dir: returns FlashInfer's cubin directory (read per call: users repoint it).
        families: which names are pooled and materialised.
        recorder: appends every served ``(name, sha256)`` to a usage record.
        seed_dirs: read-only directories (an installed ``flashinfer-cubin``) whose
            valid files are served and added to the pool, never written to.
        offline: never fetch; a miss is logged with :func:`fetch_hint`.
        final_not_found: an :class:`~distcache.errors.ArtifactNotFound` or
            :class:`~distcache.errors.IntegrityError` from the origin is final (the
            origin is FlashInfer's own repository).
    """

    def __init__(self, pool: ArtifactPool, original: GetArtifact, *, origin: Origin | None = None,
                 cubin_dir: Callable[[], Path | None] = lambda: None,
                 families: Families | None = None, recorder: Recorder | None = None,
                 seed_dirs: Callable[[], Iterable[Path]] = tuple, offline: bool = False,
                 final_not_found: bool = False) -> None:
        self.pool, self.original, self.origin = pool, original, origin
        self.cubin_dir = cubin_dir
        self.families = families or Families()
        self.recorder = recorder
        self.seed_dirs = seed_dirs
        self.offline = offline
        self.final_not_found = final_not_found
        self.stats = LoaderStats()
        self._lock = threading.Lock()
        self._unwritable: set[str] = set()  #: pools whose publication failure was logged
        self._call = threading.local()  #: this thread's call: ``missed``, see logged_miss
        #: Set when uninstalled: a wrapper another library put around this one (after
        #: the install) still calls it, and it then only hands the call to FlashInfer.
        self.retired = False
        self.__name__ = "get_artifact"
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, file_name: Any, sha256: Any, session: Any = None) -> bytes:
        if self.retired:  # uninstalled, but still called through another's wrapper
            return self.original(file_name, sha256, session)
        self._call.missed = False
        try:
            answer = self._load(file_name, sha256)
        except Exception as exc:  # distcache's own failure: FlashInfer answers
            self._note("fallbacks", str(file_name), f"unexpected {type(exc).__name__}: {exc}")
            answer = _ASK_FLASHINFER
        if isinstance(answer, bytes):
            return answer
        return self._fallback(file_name, sha256, session)

    def _load(self, file_name: Any, sha256: Any) -> bytes | object:
        escape = _escape(file_name)
        if escape is not None:
            # FlashInfer would join the name onto its cache directory and write there;
            # a name that leaves it gets FlashInfer's failure answer and touches nothing.
            self._note("rejected", repr(file_name), escape, then="answered b'' (FlashInfer's "
                       "failure answer): the name would leave FLASHINFER_CUBIN_DIR")
            return b""
        if checksum_disabled():
            # FlashInfer then returns whatever file its cubin directory holds (a kernel
            # being developed): only its own function answers, and nothing is replaced.
            self._bump("passthrough")
            return _ASK_FLASHINFER
        try:
            name = validate_name(file_name)
            check_sha256(sha256)
        except ValueError:  # a name the pool cannot store, or not a sha256
            self._bump("passthrough")
            return _ASK_FLASHINFER
        if not self.families.is_pooled(name):
            self._bump("passthrough")
            return _ASK_FLASHINFER
        artifact = Artifact(name, sha256)
        try:
            data, in_cubin_dir, pooled = self._resolve(artifact)
        except (ArtifactNotFound, IntegrityError) as exc:
            if not self.final_not_found:
                self._note("fallbacks", name, f"{type(exc).__name__}: {exc}")
                return _ASK_FLASHINFER
            # FlashInfer's own repository answered: FlashInfer would download the same
            # URL once more and get the same answer (no file, or bytes that fail its
            # own check); its answer is b"".
            kind = "not_found" if isinstance(exc, ArtifactNotFound) else "mismatched"
            self._bump(kind)
            log.error("flashinfer artifact %s (sha256 %s): %s; FlashInfer's own download of "
                      "the same URL is not tried", name, sha256, exc)
            _events.emit("flashinfer.not_found" if kind == "not_found" else
                         "flashinfer.mismatch", name=name, sha256=sha256, reason=str(exc))
            return b""
        except Exception as exc:
            self._note("fallbacks", name, f"{type(exc).__name__}: {exc}")
            return _ASK_FLASHINFER
        if data is None:
            return self._miss_without_download(artifact)
        if not in_cubin_dir and self.families.is_materialized(name):
            self._place(artifact, None if pooled else data)
        self._record(name, sha256)
        return data

    def _place(self, artifact: Artifact, data: bytes | None) -> None:
        """:meth:`_materialize`; a failure is logged once per name, the bytes served."""
        try:
            self._materialize(artifact, data)
        except Exception as exc:
            self._note(None, artifact.name, f"not written under FLASHINFER_CUBIN_DIR: "
                       f"{type(exc).__name__}: {exc}", then="serving the verified bytes")

    def _miss_without_download(self, artifact: Artifact) -> bytes | object:
        """Not in the pool and downloads are off: say what is missing and how to get
        it; FlashInfer's own function then answers (it raises its own clear error
        under ``FLASHINFER_NO_DOWNLOAD``), unless it would download."""
        if not self.offline:
            self._bump("fallbacks")
            return _ASK_FLASHINFER
        self._bump("offline_misses")
        self._call.missed = True
        pool = getattr(self.pool, "root", self.pool)
        log.error("flashinfer artifact %s (sha256 %s) is not in the pool %s and "
                  "DISTCACHE_OFFLINE=1 forbids downloads; %s",
                  artifact.name, artifact.sha256, pool, fetch_hint(artifact))
        _events.emit("flashinfer.offline_miss", name=artifact.name, sha256=artifact.sha256,
                     pool=str(pool))
        return _ASK_FLASHINFER if no_download() else b""

    def logged_miss(self) -> bool:
        """Whether this thread's last call logged an offline miss as an error (a caller
        failing because of that miss need not log it a second time)."""
        return bool(getattr(self._call, "missed", False))

    def _resolve(self, artifact: Artifact) -> tuple[bytes | None, bool, bool]:
        """The artifact's bytes (``None``: downloads are off and nothing local has
        it), whether they came from a valid file in FlashInfer's cubin directory, and
        whether the pool holds them."""
        data = self.pool.get(artifact.sha256, trust_own=True)  # verified in this job: unhashed
        if data is not None:
            self._bump("hits")
            return data, False, True
        # A file in the cubin directory counts as placed only when it is this user's
        # (own_bytes); another user's with the right bytes is served, then replaced.
        root = self.cubin_dir()
        data, in_cubin_dir = cubin_bytes(root, artifact) if root is not None else (None, False)
        for local in () if data is not None else self.seed_dirs():
            data = cubin_bytes(local, artifact)[0]
            if data is not None:
                break
        if data is not None:
            self._bump("local")
            pooled = True
            try:
                self.pool.put(data, artifact.sha256)
            except Exception as exc:
                pooled = False
                log.debug("could not add %s to the pool: %s", artifact.name, exc)
            return data, in_cubin_dir, pooled
        if self.offline or no_download():
            return None, False, False
        peered = self._from_peers(artifact)
        if peered is not None:
            return peered, False, self.pool.has(artifact.sha256)
        origin = self.origin if self.origin is not None else default_origin()
        with Keeping(origin) as keeping:
            try:
                data = self.pool.fetch(artifact, keeping)
            except PoolError as exc:
                # Publishing failed after the origin delivered (or before it was asked):
                # the caller gets the verified bytes either way, and nothing downloads
                # twice. The pool's frames, which hold the bytes it read, are let go first.
                exc.__traceback__ = None
                self._unpublished(exc)
                kept = keeping.kept
                data = kept if kept is not None and sha256_hex(kept) == artifact.sha256 else (
                    origin.fetch(artifact))
                self._bump("fetched")
                return data, False, False
        # Another thread or process may have fetched it while this one waited.
        self._bump("fetched" if keeping.asked else "hits")
        return data, False, True

    def _from_peers(self, artifact: Artifact) -> bytes | None:
        """The node agent's verified bytes, counted by where they came from; ``None``
        without a peer tier, or when it did not serve (counted)."""
        tier = peer.current()
        got = peer.lookup(artifact, tier) if tier is not None else None
        if got is None:
            if tier is not None:
                self._bump("peer_failed")
            return None
        self._bump({"peer": "peer", "fallback": "peer_fallbacks", "pool": "hits"}.get(
            got.source, "fetched"))
        _events.emit("flashinfer.lookup", name=artifact.name, sha256=artifact.sha256,
                     source=got.source, seconds=round(got.seconds, 6))
        return got.data

    def _unpublished(self, exc: PoolError) -> None:
        self._bump("unpublished")
        where = str(getattr(self.pool, "root", self.pool))
        with self._lock:
            first = where not in self._unwritable
            self._unwritable.add(where)
        if first:
            log.warning("flashinfer: pool %s cannot take downloads (%s); what is downloaded is "
                        "served from memory and fetched again by the next process: make the "
                        "pool writable or point DISTCACHE_POOL elsewhere", where, exc)
        else:
            log.debug("flashinfer: pool %s still cannot take downloads: %s", where, exc)

    def _materialize(self, artifact: Artifact, data: bytes | None) -> None:
        """Place ``artifact`` under FlashInfer's cubin directory: linked from the pool,
        or written from ``data`` when the pool does not hold it. A file :func:`placed`
        trusts is left alone (replacing it, even with identical bytes, would swap the
        inode under a compiler reading it); another user's, or one reached through a
        symlink, is replaced. An installed cubin directory (``uninstall`` ran while this
        load was in flight, and put it back) is never written."""
        root = self.cubin_dir()
        if root is None or is_installed_location(Path(root)) or placed(root, artifact):
            return
        if data is None:
            self.pool.materialize(artifact, Path(root))
            return
        write_replacing(Path(root), path_under(Path(root), artifact.name), data)

    def _fallback(self, file_name: Any, sha256: Any, session: Any) -> bytes:
        """The installed files FlashInfer was pointed away from (``seed_dirs``, read as
        FlashInfer would read them: :func:`seed_bytes`), then FlashInfer's own
        function; what it raises passes through unchanged.

        While FlashInfer's cubin directory is moved away from those files, the bytes
        returned are also kept at ``<cubin dir>/<name>`` (:func:`hold`), which
        FlashInfer's path readers (deep-gemm's kernel map, CuTe-DSL's manifests) open
        right after the call: there they would find nothing, or an older file of an
        earlier run. A failure to write is logged once per name; the bytes are served."""
        root, seeds = self.cubin_dir(), tuple(self.seed_dirs())
        data = seed_bytes(seeds, file_name, sha256, skip=root)
        seeded = data is not None  # an installed file, possibly empty
        try:
            if data is None:
                data = self.original(file_name, sha256, session)
        except Exception as exc:
            with self._lock:
                self.stats.failures.setdefault(str(file_name),
                                               f"FlashInfer: {type(exc).__name__}: {exc}")
            raise
        if not isinstance(data, bytes | bytearray):
            return b""
        data = bytes(data)
        if (seeded or data) and root is not None and any(Path(s) != root for s in seeds):
            try:
                hold(root, file_name, data)
            except Exception as exc:
                self._note(None, str(file_name), f"not written under FLASHINFER_CUBIN_DIR: "
                           f"{type(exc).__name__}: {exc}", then="serving the bytes")
        if data and isinstance(file_name, str) and isinstance(sha256, str):
            try:
                name = validate_name(file_name)
                if sha256_hex(data) == sha256:
                    self._record(name, sha256)
            except ArtifactNameError:
                pass
        return data

    def _record(self, name: str, sha256: str) -> None:
        if self.recorder is not None:
            self.recorder.add(name, sha256)

    def _bump(self, counter: str) -> None:
        with self._lock:
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _note(self, counter: str | None, name: str, reason: str, *,
              then: str = "using FlashInfer's own loader") -> None:
        """Count ``counter`` (unless None); log ``reason`` once per name."""
        if counter is not None:
            self._bump(counter)
        with self._lock:
            first = name not in self.stats.failures
            if first:
                self.stats.failures[name] = reason
        if first:
            log.warning("flashinfer artifact %s: %s; %s", name, reason, then)
