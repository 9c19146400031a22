"""``distcache.init``: the collective start-up hook an engine calls on every rank.

Composition only, in the order of DESIGN.md's data flow: a communicator of distcache's
own (:func:`distcache.comm.adopt`: a duplicate of the MPI world or a private gloo group,
never the engine's), the pool and the origin, the IPC pool handle exchange, the
start-up prefetch of the manifests and of what the integrations want
(:mod:`distcache._resolve`), each integration's install. With ``background=True`` the
prefetch and the installs run on a thread while the engine goes on; ``Session.wait``
joins them. ``init`` is told one :class:`~distcache._options.InitOptions` (its keywords
stand for the fields). A process keeps one session (:class:`SessionSlot`).
"""

from __future__ import annotations

import contextvars
import threading
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, Unpack

from distcache._beside import InstallsBeside, install_rest
from distcache._beside import phase as _phase
from distcache._log import get_logger
from distcache._options import InitFields, InitOptions, compose, jit_families
from distcache._prepare import as_lists, set_up_where_downloading
from distcache._resolve import prefetch_manifests, resolve_origin, resolve_pool
from distcache._teardown import Closing
from distcache.comm import Adopted, Communicator, adopt, bulk_transport, local, tell_others
from distcache.config import Settings, settings
from distcache.errors import DistcacheError
from distcache.integrations import Integration
from distcache.origins import Stopper
from distcache.peer import Hosted, Starting, start_for_session

if TYPE_CHECKING:
    from distcache._background import Background
    from distcache.collective import PrefetchReport, SyncState
    from distcache.ipc import PoolRegistry
    from distcache.store import ArtifactPool

__all__ = ["InitFields", "InitOptions", "Session", "SessionSlot", "current", "init"]

log = get_logger(__name__)


class Session:
    """What ``init`` set up. Use as a context manager or call :meth:`close`.

    Attributes:
        comm: the communicator every collective of this session uses.
        pool: the artifact pool (``None`` when distcache is disabled).
        registry: the IPC pool registry (``None`` unless IPC pools were exchanged).
        report: the start-up prefetch report (``None`` when nothing was prefetched).
        phases: seconds spent in each start-up phase on this rank (an install beside
            the prefetch, ``"<name>:beside"``, overlaps ``"prefetch"``).
        disabled: ``True`` when ``DISTCACHE_DISABLE=1`` made ``init`` a no-op.
        integrations: the integrations installed, in the order installed (those
            installed beside the prefetch first; ``distcache._beside``).
        options: what ``init`` was told.
    """

    comm: Communicator
    pool: ArtifactPool | None
    registry: PoolRegistry | None
    report: PrefetchReport | None
    phases: dict[str, float]
    disabled: bool
    settings: Settings | None
    integrations: list[Integration]
    options: InitOptions | None
    _sync_state: SyncState | None
    _peers: Hosted | None
    _starting: Starting | None

    def __init__(self, comm: Communicator, pool: ArtifactPool | None, *,
                 registry: PoolRegistry | None = None, report: PrefetchReport | None = None,
                 phases: dict[str, float] | None = None, disabled: bool = False,
                 settings: Settings | None = None, integrations: list[Integration] | None = None,
                 options: InitOptions | None = None, _adopted: Adopted | None = None,
                 _slot: SessionSlot | None = None) -> None:
        self.comm, self.pool, self.registry, self.report = comm, pool, registry, report
        self.disabled, self.settings, self.options = disabled, settings, options
        self.phases = {} if phases is None else phases
        self.integrations = [] if integrations is None else integrations
        self._closing, self._sync_state = Closing(), None  # close() runs once
        # The communicator adopt() made, which close() discards, and the slot it leaves;
        # the background start-up (init(background=True)): its thread, what it raised.
        self._adopted, self._slot = _adopted, _slot
        self._background: Background | None = None
        # The node agents of the peer tier this rank hosts or uses, and their start.
        self._peers, self._starting = None, None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "disabled" if self.disabled else "open"
        pool, names = self.pool and str(self.pool.root), [i.name for i in self.integrations]
        return f"Session({state}, rank {self.comm.rank}/{self.comm.size}, {pool=}, integrations={names})"

    @property
    def _thread(self) -> threading.Thread | None:
        """The background start-up's thread (``None`` for a foreground ``init``)."""
        return None if self._background is None else self._background.thread

    @property
    def ready(self) -> bool:
        """Whether the start-up is over (at once unless ``init(background=True)``);
        ``wait`` then returns without blocking. A ``DistcacheError`` in a process
        forked while the background start-up ran."""
        return self._background is None or self._background.wait(0)

    def wait(self, timeout: float | None = None) -> PrefetchReport | None:
        """Join the background start-up (the prefetch and the integrations' install)
        and return the prefetch report (before warm-up); at once when ``init`` ran in
        the foreground, or from inside the start-up (an install: it would wait for it).

        Raises:
            CollectiveTimeout: the start-up is still running after ``timeout`` seconds
                (it goes on; call ``wait`` again).
            PrefetchError, ManifestMismatchError, ConfigError, ...: what the start-up
                raised; the collective errors are raised on every rank alike.
            DistcacheError: forked from the process running the background start-up.
        """
        if self._background is not None and STARTING.get() is not self:
            self._background.join(timeout, self.comm)
        return self.report

    def sync(self, *, timeout: float | None = None) -> PrefetchReport | None:
        """Collective: artifacts any rank fetched lazily since the last sync, and what
        the session's JIT caches gained (each rank publishes its own first), reach
        every pool. A no-op on a disabled session.

        Raises:
            PrefetchError: some rank failed; raised on every rank.
            DistcacheError: the session is closed.
        """
        self._check_open()
        if self.disabled or self.pool is None:
            return None
        self.wait()  # the communicator is the background start-up's until it is done
        from distcache._sync import publish_and_sync  # loaded by the first sync
        from distcache.collective import SyncState

        if self._sync_state is None:
            self._sync_state = SyncState()
        return publish_and_sync(self.comm, self.pool, self.integrations, self._sync_state,
                                timeout)

    def close(self) -> None:
        """Uninstall the integrations, unmap IPC pools, and tear down what init
        started (a background start-up not over has its downloads stopped first).
        Idempotent and thread-safe (:class:`~distcache._teardown.Closing`); not
        collective. Every step runs even where one fails; the call that tore down raises
        the error of the last failing step (the others chained to it). A call
        interrupted while it waits for the start-up (Ctrl-C) leaves the session open."""
        if not self._closing.claim(self._thread, self.settings and self.settings.timeout):
            return
        with self._closing.tearing_down():
            self._closing.join(self._background)
            starting, slot, self._starting = self._starting, self._slot, None
            self._closing.tear_down(self.integrations, starting.abandon if starting else None,
                                    (self._peers, self.registry, self._adopted),
                                    partial(slot.leave, self) if slot else None)

    @property
    def closed(self) -> bool:
        return self._closing.closed

    def _check_open(self) -> None:
        if self.closed:
            raise DistcacheError("this distcache session is closed; call distcache.init() again")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class SessionSlot:
    """Where a process keeps its open session.

    A second ``init`` returns the open session (an engine and a library it embeds both
    call ``init``, and only one of them may adopt a communicator and install the
    integrations), a foreground one once its background start-up is over, so the
    process has one slot: the module's ``_PROCESS``, which :func:`init` and
    :func:`current` use. Tests construct their own. A session leaves its slot on
    ``close``. An ``init`` from inside a start-up (an integration's install, on any of
    its threads) returns the session being started at once (:data:`STARTING`). A
    session whose background start-up failed is closed by the next ``init``, which
    starts afresh."""

    def __init__(self) -> None:
        # Re-entrant: a start-up that fails closes its session, which leaves the slot.
        self._lock = threading.RLock()
        self._session: Session | None = None

    def current(self) -> Session | None:
        """The open session of this slot, if any."""
        session = self._session
        return session if session is not None and not session.closed else None

    def init(self, options: InitOptions | None = None, /,
             **fields: Unpack[InitFields]) -> Session:
        """:func:`init` on this slot: its open session, else a new one (raises as it)."""
        starting = STARTING.get()
        if starting is not None and starting._slot is self:
            if starting.closed:
                raise DistcacheError("init was called from inside the start-up of a "
                                     "distcache session that is closed")
            return _again(starting, options, fields)
        with self._lock:
            session = self.current()
            if session is not None and session._background and session._background.failed:
                _close_failed(session)  # as after a foreground start-up that failed
                session = None
            if session is None:
                self._session = session = _start(InitOptions.of(options, fields), self)
                return session
            _again(session, options, fields)
        if not InitOptions.of(options, fields).background and not session.ready:
            session.wait()  # a foreground init returns with the start-up over (or raises)
        return session

    def leave(self, session: Session) -> None:
        """Empty the slot if ``session`` is in it: not yet while ``init`` starts it, so
        a close from its start-up's threads never waits for ``init``'s lock."""
        if self._session is session:
            with self._lock:
                if self._session is session:
                    self._session = None


# The process's slot: module state by necessity (see SessionSlot).
_PROCESS = SessionSlot()

#: The session whose start-up runs in this context: set while ``init`` starts one on
#: the caller's thread; the start-up's threads run in copies of that context.
STARTING: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "distcache_starting", default=None)


def _again(session: Session, options: InitOptions | None, fields: InitFields) -> Session:
    """``session``, for an ``init`` that finds it; the options it ignores are named."""
    if session.options is not None and (options is not None or fields):
        session.options.warn_ignored(options, fields)
    return session


def _close_failed(session: Session) -> None:
    """Close ``session``, whose start-up failed (its own error is the one raised)."""
    try:
        session.close()
    except Exception as also:
        log.warning("closing the failed start-up: %s", also)


def current() -> Session | None:
    """The open session of this process, if any."""
    return _PROCESS.current()


def init(options: InitOptions | None = None, /, **fields: Unpack[InitFields]) -> Session:
    """Collective start-up hook; call it on every rank with the same options.

    Args:
        options: an :class:`InitOptions` (default: every field at its default).
        **fields: fields of :class:`InitOptions` (each described there) given as
            keywords, in place of those of ``options``: ``init(manifests=[M])``,
            ``init(manifests=[M], ipc_pools=[features], background=True)``,
            ``init(integrations=[FlashInfer(record=DIR)])``. What to fetch
            (``manifests``, ``integrations``, ``ipc_pools``, ``jit_caches``), where from
            and into (``pool``, ``origin``), how to run (``comm``, ``timeout``,
            ``transport``, ``background``, ``environ``).

    Returns:
        The process's session; a second call returns the same one, with the options of
        the first (``Session.options``), in the foreground once its start-up is over.

    Raises:
        ConfigError: a bad or unknown option or ``DISTCACHE_*`` value, or artifacts
            that no pool of the job holds while there is no origin or
            ``DISTCACHE_OFFLINE=1`` (one error, on every rank, naming them; what the
            pools hold needs no origin).
        ManifestError: a malformed manifest, or one name with two digests.
        ManifestMismatchError: ranks passed different manifests (on every rank).
        PrefetchError: a download or transfer failed (on every rank).
        IpcError: the IPC exchange failed.
    """
    return _PROCESS.init(options, **fields)


def _start(options: InitOptions, slot: SessionSlot) -> Session:
    """Set up a session for ``options``; on failure close what was set up."""
    conf = settings(options.environ, timeout=options.timeout, transport=options.transport)
    comm = options.comm
    if conf.disable:
        log.info("distcache disabled by DISTCACHE_DISABLE=1: init is a no-op")
        return Session(comm=comm if comm is not None else local(), pool=None,
                       disabled=True, settings=conf, options=options, _slot=slot)

    chosen = compose(options.integrations, conf)
    phases: dict[str, float] = {}
    adopted: Adopted | None = None
    with _phase(phases, "comm"):
        if comm is None:
            adopted = adopt(environ=options.environ, timeout=conf.timeout)
            comm = adopted.comm
    _log_rank0(comm, "comm: %s backend, %d rank(s)%s (%.2f s)", comm.backend, comm.size,
               f" on {adopted.rendezvous}" if adopted and adopted.rendezvous else "",
               phases["comm"])
    session = Session(comm=comm, pool=None, phases=phases, settings=conf, options=options,
                      _adopted=adopted, _slot=slot)
    starting, stop = STARTING.set(session), None
    try:
        with _phase(phases, "pool"):
            session.pool = the_pool = resolve_pool(options.pool, conf)
        _log_rank0(comm, "pool: %s (id %s)", the_pool.root, the_pool.pool_id)
        chosen = [*chosen, *jit_families(options.jit_caches, conf, the_pool, options.environ)]
        origin = resolve_origin(options.origin, conf, chosen)
        stopper = None if origin is None else Stopper(origin)
        the_origin, stop = (None, None) if stopper is None else (
            stopper.origin, partial(stopper.interrupt, the_pool.layout.tmp))
        secret = adopted.scope.secret if adopted else None
        manifests = as_lists(options.manifests)  # read by the set-up, then the prefetch
        with _phase(phases, "peers"):
            setting_up = set_up_where_downloading(comm, the_pool, the_origin, manifests,
                                                  chosen, conf.offline, conf.timeout, conf)
            session._starting = start_for_session(  # in the background: no wait for it
                comm, the_pool, the_origin, secret, conf.peers, timeout=conf.timeout,
                environ=options.environ, after=None if options.background else setting_up)
            if options.background:
                # Lookups the engine makes while the start-up runs find the peers.
                _share_peers(session)
        if options.ipc_pools is not None:
            from distcache.ipc import PoolRegistry  # loaded by the jobs that map pools

            with _phase(phases, "ipc"):
                session.registry = PoolRegistry.exchange(comm, list(options.ipc_pools),
                                                         timeout=conf.timeout)
            _log_rank0(comm, "ipc: %d pool(s) mapped once each (%.2f s)",
                       len(session.registry.opens), phases["ipc"])

        def start_up() -> None:
            # Nothing looks artifacts up before a foreground init returns (_beside.py).
            beside = InstallsBeside(() if options.background else chosen, the_pool,
                                    the_origin, phases)
            over = False
            try:
                beside.start()
                with _phase(phases, "prefetch"), bulk_transport(comm, conf.transport,
                                                                 conf.timeout) as moving:
                    session.report = prefetch_manifests(
                        moving, the_pool, the_origin, manifests=manifests,
                        integrations=chosen, timeout=conf.timeout, offline=conf.offline,
                        aside=session._starting, set_up=False, conf=conf)
                over = True
            finally:  # what was installed is uninstalled by close(), whatever happened
                early = beside.join_into(session.integrations, failing=not over)
            if session.report is not None:
                _log_rank0(comm, "%s", session.report.summary())
            # The node agents started beside the prefetch; their endpoints came with its
            # report, else are shared now (collective), before any install can fail.
            with _phase(phases, "peers"):
                _share_peers(session)
            beside.check()
            note = session._closing.unless_torn_down(  # no install after a close
                session.integrations, lambda *line: _log_rank0(comm, *line))
            install_rest(chosen, early, the_pool, the_origin, phases, session.integrations,
                         note)

        if options.background:
            from distcache._background import Background  # where one runs in background
            session._background = Background(start_up, comm, stop)
            session._background.start()
        else:
            start_up()
    except BaseException as exc:
        tell_others(comm, exc)  # before the close: their waits raise it, not time out
        if stop is not None:  # its downloads end at their next write (Ctrl-C)
            stop(())
        _close_failed(session)
        raise
    finally:
        STARTING.reset(starting)
    return session


def _share_peers(session: Session) -> None:
    """Collective where the node agents were begun: share their endpoints and attach
    this rank's tier (:meth:`distcache.peer.Starting.finish`)."""
    starting, session._starting = session._starting, None
    if starting is not None:
        session._peers = starting.finish()
        if session._closing.torn_down and session._peers is not None:
            session._peers.close()  # closed meanwhile on this thread: keep nothing


def _log_rank0(comm: Communicator, msg: str, *args: Any) -> None:
    if comm.rank == 0:
        log.info(msg, *args)
