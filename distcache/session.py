"""``distcache.init``: the collective start-up hook an engine calls on every rank.

It composes the parts in the order of DESIGN.md's data flow: adopt a communicator,
open the pool, prefetch the manifests (and the FlashInfer usage record), install the
FlashInfer loader wrapper, exchange IPC pool handles. The process keeps one session:
a second ``init`` returns it, so an engine and a library it embeds can both call
``init`` safely.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from distcache.artifact import Artifact, read_manifest
from distcache.comm import Communicator, local
from distcache.config import Settings, settings
from distcache.errors import ConfigError, DistcacheError

if TYPE_CHECKING:
    from distcache.collective._core import PrefetchReport, SyncState
    from distcache.ipc import PoolRegistry
    from distcache.origins._origin import Origin
    from distcache.store._pool import ArtifactPool

__all__ = ["Session", "current", "init"]

log = logging.getLogger(__name__)

ManifestSpec = str | os.PathLike[str] | Sequence[Artifact]

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
    """

    comm: Communicator
    pool: ArtifactPool | None
    registry: PoolRegistry | None = None
    report: PrefetchReport | None = None
    phases: dict[str, float] = field(default_factory=dict)
    disabled: bool = False
    settings: Settings | None = None
    _flashinfer_installed: bool = False
    _closed: bool = False
    _sync_state: SyncState | None = None
    # init brought torch.distributed up itself (no group existed): close tears it down,
    # since a process exiting with a live gloo group may abort in its destructor.
    _owns_process_group: bool = False

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
        from distcache.collective._core import SyncState, sync

        if self._sync_state is None:
            self._sync_state = SyncState()
        report = sync(comm=self.comm, pool=self.pool, timeout=timeout, state=self._sync_state)
        _log_rank0(self.comm, "sync: %s", report.summary())
        return report

    def close(self) -> None:
        """Uninstall the FlashInfer wrapper and unmap IPC pools. Idempotent; not
        collective."""
        global _current
        if self._closed:
            return
        self._closed = True
        if self._flashinfer_installed:
            from distcache.integrations import flashinfer

            flashinfer.uninstall()
        if self.registry is not None:
            self.registry.close()
        if self._owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
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
    flashinfer: bool | None = None,
    flashinfer_record: str | os.PathLike[str] | None = None,
    ipc_pools: Sequence[Any] | None = None,
    timeout: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> Session:
    """Collective start-up hook; call it on every rank with the same arguments.

    Args:
        comm: a communicator; default: adopt torch.distributed if initialised, else the
            MPI world when launched under MPI, else bring up torch.distributed through
            ``launch`` when a multi-rank launcher is detected, else world size 1.
        pool: an ``ArtifactPool`` or its directory; default ``DISTCACHE_POOL``.
        origin: where missing artifacts come from; default ``DISTCACHE_ORIGIN``.
        manifests: ``sha256sum``-format files or lists of artifacts to prefetch.
        flashinfer: install the FlashInfer loader wrapper (default: when FlashInfer is
            importable and ``DISTCACHE_FLASHINFER`` is not 0).
        flashinfer_record: a usage-record directory; what it lists is prefetched and
            every artifact FlashInfer asks for is appended to it.
        ipc_pools: this rank's IPC producer pools; when given (even empty) the
            registry exchange runs (collectively).
        timeout: seconds for each collective (default ``DISTCACHE_TIMEOUT``).

    Returns:
        The process's session; a second call returns the same one.

    Raises:
        ConfigError: a bad argument or ``DISTCACHE_*`` value, or a manifest without
            an origin.
        ManifestMismatchError: ranks passed different manifests (on every rank).
        PrefetchError: a download or transfer failed (on every rank).
        IpcError: the IPC exchange failed.
    """
    global _current
    with _lock:
        if _current is not None and not _current.closed:
            return _current
    conf = settings(environ, timeout=timeout)
    if conf.disable:
        session = Session(comm=comm if comm is not None else local(), pool=None,
                          disabled=True, settings=conf)
        log.info("distcache disabled by DISTCACHE_DISABLE=1: init is a no-op")
        with _lock:
            _current = session
        return session

    phases: dict[str, float] = {}
    owns_group = False
    with _phase(phases, "comm"):
        if comm is None:
            comm, owns_group = _adopt_comm(environ)
    _log_rank0(comm, "comm: %s backend, %d rank(s) (%.2f s)", comm.backend, comm.size,
               phases["comm"])

    from distcache.store._pool import ArtifactPool

    with _phase(phases, "pool"):
        the_pool = pool if isinstance(pool, ArtifactPool) else ArtifactPool(
            Path(pool) if pool is not None else conf.pool_dir, max_bytes=conf.pool_max_bytes
        )
    _log_rank0(comm, "pool: %s (id %s)", the_pool.root, the_pool.pool_id)

    use_flashinfer = _want_flashinfer(flashinfer, conf)
    the_origin = _resolve_origin(origin, conf, use_flashinfer)
    artifacts = _load_manifests(manifests)

    session = Session(comm=comm, pool=the_pool, phases=phases, settings=conf,
                      _owns_process_group=owns_group)
    try:
        if artifacts or flashinfer_record is not None:
            with _phase(phases, "prefetch"):
                session.report = _prefetch(comm, the_pool, the_origin, artifacts,
                                           flashinfer_record, conf)
            _log_rank0(comm, "prefetch: %s", session.report.summary())
        if use_flashinfer:
            from distcache.integrations import flashinfer as fi

            with _phase(phases, "flashinfer"):
                fi.install(the_pool, origin=the_origin, record=flashinfer_record)
            session._flashinfer_installed = True
            _log_rank0(comm, "flashinfer: loader wrapper installed (%.2f s)",
                       phases["flashinfer"])
        if ipc_pools is not None:
            from distcache.ipc import PoolRegistry

            with _phase(phases, "ipc"):
                session.registry = PoolRegistry.exchange(comm, list(ipc_pools),
                                                         timeout=conf.timeout)
            _log_rank0(comm, "ipc: %d pool(s) mapped once each (%.2f s)",
                       len(session.registry.opens), phases["ipc"])
    except BaseException:
        session.close()
        raise
    with _lock:
        _current = session
    return session


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


def _adopt_comm(environ: Mapping[str, str] | None) -> tuple[Communicator, bool]:
    """The communicator to use, and whether init brought torch.distributed up itself."""
    import launch
    from distcache.comm.adopt import torch_is_initialised

    env = os.environ if environ is None else environ
    if torch_is_initialised():
        from distcache.comm import from_torch

        return from_torch(), False
    info = launch.detect(env)
    # Ranks that already share an MPI world adopt it instead of bringing up
    # torch.distributed (mpi4py is imported only then: importing it calls MPI_Init).
    if info.is_mpi:
        from distcache.comm import from_mpi

        return from_mpi(), False
    if info.world_size > 1:
        launch.init_process_group(info)
        from distcache.comm import from_torch

        return from_torch(), True
    return local(), False


def _want_flashinfer(flag: bool | None, conf: Settings) -> bool:
    if flag is not None:
        return flag and conf.flashinfer
    return conf.flashinfer and importlib.util.find_spec("flashinfer") is not None


def _resolve_origin(
    origin: Origin | str | Sequence[str] | None, conf: Settings, use_flashinfer: bool
) -> Origin | None:
    from distcache.origins._origin import open_origin

    if origin is not None:
        return open_origin(origin)
    if conf.origins:
        return open_origin(list(conf.origins))
    if use_flashinfer:
        repo = os.environ.get("FLASHINFER_CUBINS_REPOSITORY")
        if repo:
            return open_origin(repo)
    return None


def _load_manifests(manifests: Sequence[ManifestSpec]) -> list[Artifact]:
    if isinstance(manifests, str | os.PathLike):
        raise ConfigError(
            "manifests must be a list of files or artifact lists, not a single path",
            variable="manifests", value=str(manifests),
        )
    merged: dict[str, Artifact] = {}
    for spec in manifests:
        items = read_manifest(spec) if isinstance(spec, str | os.PathLike) else spec
        for artifact in items:
            merged[artifact.name] = artifact
    return list(merged.values())


def _prefetch(
    comm: Communicator,
    pool: ArtifactPool,
    origin: Origin | None,
    artifacts: list[Artifact],
    record: str | os.PathLike[str] | None,
    conf: Settings,
) -> PrefetchReport:
    if record is not None:
        from distcache.integrations import flashinfer as fi

        return fi.prefetch(comm=comm, pool=pool, manifest=artifacts, record=record,
                           origin=origin, timeout=conf.timeout)
    if origin is None:
        raise ConfigError(
            "a manifest was given but no origin: pass origin=... or set DISTCACHE_ORIGIN",
            variable="DISTCACHE_ORIGIN", value=None,
        )
    from distcache.collective._core import prefetch

    return prefetch(artifacts, comm=comm, pool=pool, origin=origin, timeout=conf.timeout)
