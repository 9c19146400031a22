"""``distcache.init``: the collective start-up hook an engine calls on every rank.

Composition only, in the order of DESIGN.md's data flow: a communicator of
distcache's own (:func:`distcache.comm.adopt`: a duplicate of the MPI world or a
private gloo group, never the engine's groups), the pool and the origin, the IPC pool
handle exchange, the start-up prefetch of the manifests and of what the integrations
want (:mod:`distcache._resolve`), each integration's install. With
``background=True`` the prefetch and the installs run on a thread over that private
communicator while the engine goes on (loading weights, say); ``Session.wait`` joins
them. The process keeps one session:
a second ``init`` returns it, so an engine and a library it embeds can both call
``init`` safely.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from distcache._resolve import ManifestSpec, prefetch_manifests, resolve_origin, resolve_pool
from distcache.collective import SyncState, sync
from distcache.comm import Adopted, Communicator, adopt, bulk_transport, local
from distcache.config import Settings, settings
from distcache.errors import CollectiveTimeout, ConfigError, DistcacheError
from distcache.integrations import Integration
from distcache.integrations.flashinfer import FlashInfer
from distcache.ipc import PoolRegistry

if TYPE_CHECKING:
    from distcache.collective import PrefetchReport
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

__all__ = ["Session", "current", "init"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
# The one session of this process. A second init() must return it (engines and the
# libraries they embed both call init), so it is module state by necessity; close()
# clears it and tests construct sessions through init() like any caller.
_current: Session | None = None


@dataclass
class Session:
    """What ``init`` set up. Use as a context manager or call :meth:`close`.

    Attributes:
        comm: the communicator every collective of this session uses.
        pool: the artifact pool (``None`` when distcache is disabled).
        registry: the IPC pool registry (``None`` unless IPC pools were exchanged).
        report: the start-up prefetch report (``None`` when nothing was prefetched).
        phases: seconds spent in each start-up phase on this rank.
        disabled: ``True`` when ``DISTCACHE_DISABLE=1`` made ``init`` a no-op.
        integrations: the integrations installed, in order.
    """

    comm: Communicator
    pool: ArtifactPool | None
    registry: PoolRegistry | None = None
    report: PrefetchReport | None = None
    phases: dict[str, float] = field(default_factory=dict)
    disabled: bool = False
    settings: Settings | None = None
    integrations: list[Integration] = field(default_factory=list)
    _closed: bool = False
    _sync_state: SyncState | None = None
    # The communicator adopt() made for this session; close() discards it.
    _adopted: Adopted | None = None
    # The background start-up (init(background=True)) and what it raised.
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    @property
    def ready(self) -> bool:
        """Whether the start-up is over (at once unless ``init(background=True)``);
        ``wait`` then returns without blocking."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> PrefetchReport | None:
        """Join the background start-up (the prefetch and the integrations' install)
        and return the prefetch report; at once when ``init`` ran in the foreground.
        Call it before warm-up.

        Raises:
            CollectiveTimeout: the start-up is still running after ``timeout`` seconds
                (it goes on; call ``wait`` again).
            PrefetchError, ManifestMismatchError, ConfigError, ...: what the start-up
                raised; the collective errors are raised on every rank alike.
        """
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise CollectiveTimeout(
                    f"rank {self.comm.rank}/{self.comm.size}: the background start-up is "
                    f"still running after {timeout:g} s",
                    op="wait", timeout=timeout, rank=self.comm.rank,
                )
        if self._error is not None:
            raise self._error
        return self.report

    def sync(self, *, timeout: float | None = None) -> PrefetchReport | None:
        """Collective: artifacts any rank fetched lazily since the last sync reach every
        pool. A no-op on a disabled session.

        Raises:
            PrefetchError: some rank failed; raised on every rank.
            DistcacheError: the session is closed.
        """
        self._check_open()
        if self.disabled or self.pool is None:
            return None
        self.wait()  # the communicator is the background start-up's until it is done
        if self._sync_state is None:
            self._sync_state = SyncState()
        report = sync(comm=self.comm, pool=self.pool, timeout=timeout, state=self._sync_state)
        _log_rank0(self.comm, "sync: %s", report.summary())
        return report

    def close(self) -> None:
        """Uninstall the integrations, unmap IPC pools, and tear down what init
        started. Idempotent; not collective."""
        global _current
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            # Every collective of the start-up is bounded by the timeout, so this ends.
            self._thread.join()
        for integration in reversed(self.integrations):
            integration.uninstall()
        if self.registry is not None:
            self.registry.close()
        if self._adopted is not None:
            self._adopted.close()
        with _lock:
            if _current is self:
                _current = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise DistcacheError("this distcache session is closed; call distcache.init() again")

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def current() -> Session | None:
    """The open session of this process, if any."""
    return _current


def init(
    *,
    comm: Communicator | None = None,
    pool: ArtifactPool | str | os.PathLike[str] | None = None,
    origin: Origin | str | Sequence[str] | None = None,
    manifests: Sequence[ManifestSpec] = (),
    integrations: Sequence[Integration] = (),
    flashinfer: bool | None = None,
    flashinfer_record: str | os.PathLike[str] | None = None,
    ipc_pools: Sequence[Any] | None = None,
    timeout: float | None = None,
    environ: Mapping[str, str] | None = None,
    background: bool = False,
    transport: str | None = None,
) -> Session:
    """Collective start-up hook; call it on every rank with the same arguments.

    Args:
        comm: a communicator; default: one of distcache's own from
            :func:`distcache.comm.adopt` (a duplicate of the MPI world under MPI, else
            a private gloo group on the launcher's rendezvous store, else world size
            1). torch.distributed's default group is never initialised, adopted or
            destroyed, whether the engine made it before ``init`` or makes it after.
        pool: an ``ArtifactPool`` or its directory; default ``DISTCACHE_POOL``.
        origin: where missing artifacts come from; default ``DISTCACHE_ORIGIN``, else
            the first default an integration offers.
        manifests: ``sha256sum``-format files or lists of artifacts to prefetch.
        integrations: consumers of artifacts to serve from the pool; what they want
            (on any rank) is prefetched, then each is installed.
        flashinfer: shorthand for :class:`~distcache.integrations.flashinfer.FlashInfer`
            in ``integrations``: ``True`` adds it, ``False`` removes it, ``None`` adds
            it when FlashInfer is importable. ``DISTCACHE_FLASHINFER=0`` removes it.
        flashinfer_record: the usage-record directory of the FlashInfer integration
            the shorthand adds: what it lists is prefetched and every artifact
            FlashInfer asks for is appended to it.
        ipc_pools: this rank's IPC producer pools; when given (even empty) the
            registry exchange runs (collectively).
        timeout: seconds for each collective (default ``DISTCACHE_TIMEOUT``).
        environ: the environment to read settings and the launch from (default
            ``os.environ``).
        background: run the prefetch and the integrations' install on a thread over
            distcache's own communicator and return at once; ``Session.wait`` joins
            it (and raises what it raised, on every rank alike).
        transport: how the prefetch moves bulk bytes: ``"default"`` (over the MPI or
            gloo communicator) or ``"nccl"`` (a dedicated NCCL group made for the
            prefetch and destroyed after it; the control plane stays on MPI or gloo);
            default ``DISTCACHE_TRANSPORT``.

    Returns:
        The process's session; a second call returns the same one.

    Raises:
        ConfigError: a bad argument or ``DISTCACHE_*`` value, or artifacts that no
            pool of the job holds while there is no origin or ``DISTCACHE_OFFLINE=1``
            (one error, on every rank, naming them; what the pools hold needs no
            origin).
        ManifestError: a malformed manifest, or one name with two digests.
        ManifestMismatchError: ranks passed different manifests (on every rank).
        PrefetchError: a download or transfer failed (on every rank).
        IpcError: the IPC exchange failed.
    """
    global _current
    with _lock:
        if _current is not None and not _current.closed:
            return _current
    conf = settings(environ, timeout=timeout, transport=transport)
    if conf.disable:
        session = Session(comm=comm if comm is not None else local(), pool=None,
                          disabled=True, settings=conf)
        log.info("distcache disabled by DISTCACHE_DISABLE=1: init is a no-op")
        with _lock:
            _current = session
        return session

    chosen = compose(integrations, flashinfer, flashinfer_record, conf)
    phases: dict[str, float] = {}
    adopted: Adopted | None = None
    with _phase(phases, "comm"):
        if comm is None:
            adopted = adopt(environ=environ, timeout=conf.timeout)
            comm = adopted.comm
    _log_rank0(comm, "comm: %s backend, %d rank(s)%s (%.2f s)", comm.backend, comm.size,
               f" on {adopted.rendezvous}" if adopted and adopted.rendezvous else "",
               phases["comm"])
    session = Session(comm=comm, pool=None, phases=phases, settings=conf, _adopted=adopted)
    try:
        with _phase(phases, "pool"):
            session.pool = the_pool = resolve_pool(pool, conf)
        _log_rank0(comm, "pool: %s (id %s)", the_pool.root, the_pool.pool_id)
        the_origin = resolve_origin(origin, conf, chosen)
        if ipc_pools is not None:
            with _phase(phases, "ipc"):
                session.registry = PoolRegistry.exchange(comm, list(ipc_pools),
                                                         timeout=conf.timeout)
            _log_rank0(comm, "ipc: %d pool(s) mapped once each (%.2f s)",
                       len(session.registry.opens), phases["ipc"])

        def start_up() -> None:
            with _phase(phases, "prefetch"), bulk_transport(
                comm, conf.transport, conf.timeout
            ) as moving:
                session.report = prefetch_manifests(moving, the_pool, the_origin,
                                                    manifests=manifests, integrations=chosen,
                                                    timeout=conf.timeout, offline=conf.offline)
            if session.report is not None:
                _log_rank0(comm, "%s", session.report.summary())
            for integration in chosen:
                with _phase(phases, integration.name):
                    integration.install(the_pool, the_origin)
                session.integrations.append(integration)
                _log_rank0(comm, "%s: installed (%.2f s)", integration.name,
                           phases[integration.name])

        if background:
            session._thread = threading.Thread(
                target=_run_recording, args=(start_up, session), daemon=True,
                name="distcache-start-up",
            )
            session._thread.start()
        else:
            start_up()
    except BaseException:
        session.close()
        raise
    with _lock:
        _current = session
    return session


def _run_recording(body: Any, session: Session) -> None:
    """Run the background start-up; keep what it raised for ``Session.wait``."""
    try:
        body()
    except BaseException as exc:
        session._error = exc
        log.debug("background start-up failed: %s", exc)


def compose(
    integrations: Sequence[Integration],
    flashinfer: bool | None,
    flashinfer_record: str | os.PathLike[str] | None,
    conf: Settings,
) -> list[Integration]:
    """The integrations ``init`` installs: ``integrations``, with FlashInfer added or
    removed as the ``flashinfer`` shorthand and ``DISTCACHE_FLASHINFER`` say.

    Raises:
        ConfigError: ``integrations`` holds something that is not an integration.
    """
    chosen = list(integrations)
    for integration in chosen:
        if not isinstance(integration, Integration):
            raise ConfigError(
                f"{integration!r} is not an Integration (name, available(), "
                "default_origin(), manifest(), install(), uninstall(), materialize_dir())",
                variable="integrations", value=repr(integration),
            )
    present = any(isinstance(i, FlashInfer) for i in chosen)
    if flashinfer is False or not conf.flashinfer:
        return [i for i in chosen if not isinstance(i, FlashInfer)]
    if not present:
        candidate = FlashInfer(flashinfer_record)
        if flashinfer or candidate.available():
            chosen.append(candidate)
    return chosen


@contextmanager
def _phase(phases: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = time.perf_counter() - start


def _log_rank0(comm: Communicator, msg: str, *args: Any) -> None:
    if comm.rank == 0:
        log.info(msg, *args)
