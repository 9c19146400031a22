"""Putting the loader wrapper into FlashInfer and taking it out again.

FlashInfer's C++ side reaches ``get_artifact`` through a ctypes callback that looks
the module attribute up on every call, and a few FlashInfer modules import the
function by name, so :func:`install` rebinds every one of those references. Where
the installed wrapper is kept is a :class:`LoaderSlot`; FlashInfer has one loader
per process (a module-level function), so the process has one slot, behind
:func:`install`, :func:`uninstall` and :func:`installed`.

Where files go: when FlashInfer's ``FLASHINFER_CUBIN_DIR`` lies in site-packages (an
installed ``flashinfer-cubin``) or is not writable, :func:`install` points every
FlashInfer module's ``FLASHINFER_CUBIN_DIR`` at FlashInfer's own writable cache
directory; the installed files stay readable (they are served, added to the pool, and
written into that cache when FlashInfer opens them by path) and are never written to.
With ``FLASHINFER_CUBIN_CHECKSUM_DISABLED`` set at install, nothing is moved.

Offline: with ``DISTCACHE_OFFLINE=1`` the wrapper fetches nothing and
``FLASHINFER_NO_DOWNLOAD=1`` is set for FlashInfer's own loader.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from distcache import _events
from distcache._log import get_logger
from distcache.config import settings
from distcache.integrations.flashinfer._download import RoutedDownload
from distcache.integrations.flashinfer._families import Families
from distcache.integrations.flashinfer._loader import GetArtifact, PooledLoader
from distcache.integrations.flashinfer._record import Recorder
from distcache.integrations.flashinfer._upstream import (
    CUBIN_DIR_VARIABLE,
    LOADER_MODULE,
    REPOSITORY_VARIABLE,
    allow_downloads,
    checksum_disabled,
    cubin_dir,
    flashinfer_cache_dir,
    forbid_downloads,
    loader_attr,
    loader_module,
    repository,
    writable_cubin_dir,
)

if TYPE_CHECKING:
    from distcache.config import Settings
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = get_logger(__name__)


class _Installation(NamedTuple):
    loader: PooledLoader
    original: GetArtifact
    key: tuple[int, int, str | None, Families]
    #: FLASHINFER_CUBIN_DIR before it was repointed (None: not repointed).
    installed_dir: Path | None = None
    writable_dir: Path | None = None
    #: FLASHINFER_NO_DOWNLOAD was set by install and is unset by uninstall.
    set_no_download: bool = False
    #: Stands in for FlashInfer's download_file (see _download).
    download: RoutedDownload | None = None
    #: What install() was given (pool, origin, record, families), to install it again.
    given: tuple[Any, ...] = ()
    #: The installation this one replaced (a zero-code hook's, under a session's):
    #: installed again when this one is taken out by uninstall_if.
    replaced: _Installation | None = None


def _flashinfer_modules() -> list[Any]:
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and (name == "flashinfer" or name.startswith("flashinfer."))
    ]


def _rebind(*replacements: tuple[object, object]) -> list[str]:
    """Every FlashInfer module attribute that is one of the ``old`` objects of
    ``replacements`` (``(old, new)`` pairs) -> its ``new``, in one pass over the modules.

    FlashInfer has hundreds of modules and few hold a loader function: a module whose
    namespace holds none of the objects is passed over by a set test on identities,
    without a Python-level loop over its attributes.
    """
    olds = {id(old): old for old, _ in replacements}
    news = {id(old): new for old, new in replacements}
    changed = []
    for module in _flashinfer_modules():
        namespace = vars(module)
        if olds.keys().isdisjoint(map(id, list(namespace.values()))):
            continue
        for attr, value in list(namespace.items()):
            if id(value) in olds and olds[id(value)] is value:
                setattr(module, attr, news[id(value)])
                changed.append(f"{module.__name__}.{attr}")
    return changed


def _repoint(old: Path, new: Path) -> list[str]:
    """Every FlashInfer module's ``FLASHINFER_CUBIN_DIR`` equal to ``old`` -> ``new``."""
    changed = []
    for module in _flashinfer_modules():
        value = vars(module).get(CUBIN_DIR_VARIABLE)
        if value is not None and Path(value) == old:
            setattr(module, CUBIN_DIR_VARIABLE, new)
            changed.append(module.__name__)
    return changed


def _is_flashinfers_repository(origin: Origin | None, conf: Settings) -> bool:
    """True when misses go to the repository FlashInfer's own loader would download
    from: then its "not found" is the answer FlashInfer would get, after retries."""
    repo = repository() or str(loader_attr(REPOSITORY_VARIABLE) or "")
    if origin is not None:
        return _same_place(origin.describe(), repo)
    return not conf.origins or (len(conf.origins) == 1 and _same_place(conf.origins[0], repo))


def _same_place(a: str, b: str) -> bool:
    """Whether two origin URLs name one place: scheme, host (in any spelling or case)
    and port, and path; user-info (which a description leaves out) and query aside."""
    from urllib.parse import urlsplit

    from distcache.origins._credentials import host_key

    try:
        return ((host_key(a), urlsplit(a).path.rstrip("/"))
                == (host_key(b), urlsplit(b).path.rstrip("/")))
    except ValueError:  # not a URL whose port or host can be read: compared as written
        return a.rstrip("/") == b.rstrip("/")


def _choose_cubin_dir() -> tuple[Path | None, Path | None]:
    """``(installed, writable)`` when FlashInfer's cubin directory must be moved to a
    writable cache; ``(None, None)`` when it may be written as it is, or is to stay
    where it is: with ``FLASHINFER_CUBIN_CHECKSUM_DISABLED`` set, every call goes to
    FlashInfer's own loader, which then reads (and its path readers open) whatever
    file that directory holds, as if distcache were absent."""
    if checksum_disabled():
        return None, None
    current = cubin_dir()
    target = writable_cubin_dir(current)
    if current is None or target == current:
        return None, None
    if target is None:
        log.warning("flashinfer: %s=%s is not writable and neither is FlashInfer's cache "
                    "directory %s; files FlashInfer opens by path (headers, checksums.txt) "
                    "are not materialised and its JIT builds that include them fail: set "
                    "%s, or FLASHINFER_WORKSPACE_BASE, to a writable directory before "
                    "FlashInfer is imported", CUBIN_DIR_VARIABLE, current,
                    flashinfer_cache_dir(), CUBIN_DIR_VARIABLE)
        return current, None
    return current, target


class LoaderSlot:
    """Where the installed wrapper is kept, and the lock that orders installs.

    FlashInfer looks its loader up as the module attribute ``get_artifact`` (its
    ctypes callback does, on every call), so a process has one loader and one slot:
    the module's ``_PROCESS``, which :func:`install`, :func:`uninstall`,
    :func:`uninstall_if` and :func:`installed` use, and which the ``atexit`` report
    reads. A second slot would rebind the same FlashInfer modules; tests construct
    one to check install and uninstall on their own.
    """

    def __init__(self) -> None:
        self._installed: _Installation | None = None
        self._lock = threading.Lock()

    def install(
        self,
        pool: ArtifactPool,
        origin: Origin | None = None,
        record: str | os.PathLike[str] | None = None,
        *,
        families: Families | None = None,
    ) -> PooledLoader | None:
        """:func:`install` into this slot.

        Raises:
            ConfigError: a bad ``DISTCACHE_*`` value, or FlashInfer is not importable.
        """
        conf = settings()
        if conf.disable or not conf.flashinfer:
            log.info("flashinfer integration disabled (DISTCACHE_DISABLE / DISTCACHE_FLASHINFER)")
            return None
        fams = families if families is not None else Families.from_settings(conf)
        key = (id(pool), id(origin), os.fspath(record) if record is not None else None, fams)
        loader_module()  # imports FlashInfer, or raises ConfigError
        with self._lock:
            replaced = self._installed
            if replaced is not None:
                if replaced.key == key:
                    return replaced.loader
                self._uninstall_locked()
            return self._install_locked(pool, origin, record, fams, key, replaced)

    def _install_locked(self, pool: ArtifactPool, origin: Origin | None,
                        record: str | os.PathLike[str] | None, fams: Families,
                        key: tuple[int, int, str | None, Families],
                        replaced: _Installation | None) -> PooledLoader:
        """The body of :meth:`install`, under the slot's lock."""
        conf = settings()
        original: GetArtifact = sys.modules[LOADER_MODULE].get_artifact
        installed_dir, writable_dir = _choose_cubin_dir()
        loader = PooledLoader(
            pool,
            original,
            origin=origin,
            cubin_dir=cubin_dir,
            families=fams,
            recorder=Recorder(record) if record is not None else None,
            seed_dirs=lambda: (installed_dir,) if installed_dir is not None else (),
            offline=conf.offline,
            final_not_found=_is_flashinfers_repository(origin, conf),
        )
        original_download = loader_attr("download_file")
        download = (RoutedDownload(loader, original_download, offline=conf.offline)
                    if callable(original_download) else None)
        changed = _rebind((original, loader), *(
            [(original_download, download)] if download is not None else []))
        if writable_dir is not None and installed_dir is not None:
            moved = _repoint(installed_dir, writable_dir)
            log.info("flashinfer: %s moved from %s to %s in %s; the installed files are "
                     "read, never written", CUBIN_DIR_VARIABLE, installed_dir,
                     writable_dir, ", ".join(moved))
        self._installed = _Installation(
            loader=loader, original=original, key=key, installed_dir=installed_dir,
            writable_dir=writable_dir, download=download,
            set_no_download=forbid_downloads() if conf.offline else False,
            given=(pool, origin, record, fams), replaced=replaced,
        )
        log.info("flashinfer: get_artifact served from pool %s (rebound %s)%s",
                 getattr(pool, "root", pool), ", ".join(changed),
                 "; offline: no origin is contacted" if conf.offline else "")
        return loader

    def _uninstall_locked(self) -> None:
        done = self._installed
        if done is None:
            return
        # Modules imported after install() copied the loader; they are restored too.
        _rebind((done.loader, done.original), *(
            [(done.download, done.download.original)] if done.download is not None else []))
        done.loader.retired = True
        wrapper = sys.modules[LOADER_MODULE].get_artifact
        if wrapper is not done.original:
            log.warning("flashinfer: get_artifact is %r, which another library put around "
                        "distcache's wrapper after its install: it stays, and distcache's "
                        "now hands each call it gets to FlashInfer's own function", wrapper)
        if done.writable_dir is not None and done.installed_dir is not None:
            _repoint(done.writable_dir, done.installed_dir)
        if done.set_no_download:
            allow_downloads()
        _report(done.loader)
        if done.loader.recorder is not None:
            done.loader.recorder.close(final=True)
        self._installed = None

    def uninstall(self) -> None:
        """:func:`uninstall` for this slot."""
        with self._lock:
            self._uninstall_locked()

    def uninstall_if(self, loader: PooledLoader) -> None:
        """:meth:`uninstall`, only while ``loader`` is this slot's wrapper; the
        installation it replaced (the zero-code hook's, under a session's) is put back,
        its offline switch with it."""
        with self._lock:
            done = self._installed
            if done is None or done.loader is not loader:
                return
            self._uninstall_locked()
            back = done.replaced
            if back is None:
                return
            pool, origin, record, fams = back.given
            try:
                self._install_locked(pool, origin, record, fams, back.key, back.replaced)
            except Exception as exc:  # FlashInfer's own loader stays, as after uninstall()
                log.warning("flashinfer: the wrapper installed before %s could not be put "
                            "back: %s", loader, exc)

    def installed(self) -> PooledLoader | None:
        """This slot's active loader, or ``None``."""
        done = self._installed
        return done.loader if done is not None else None


def _report(loader: PooledLoader) -> None:
    """The loader's statistics as a ``flashinfer.loader`` event (when it did anything)."""
    stats = loader.stats.as_dict()
    failures = stats.pop("failures")
    if any(stats.values()) or failures:
        _events.emit("flashinfer.loader", pool=str(getattr(loader.pool, "root", "")),
                     failures=len(failures), **stats)


#: The process's slot: FlashInfer has one loader per process (see LoaderSlot).
_PROCESS = LoaderSlot()


def install(
    pool: ArtifactPool,
    origin: Origin | None = None,
    record: str | os.PathLike[str] | None = None,
    *,
    families: Families | None = None,
) -> PooledLoader | None:
    """Serve FlashInfer's ``get_artifact`` from ``pool``; idempotent.

    Rebinds ``flashinfer.jit.cubin_loader.get_artifact`` (and its ``get_cubin``
    alias, and every FlashInfer module that imported it by name) to a
    :class:`PooledLoader`. Moves ``FLASHINFER_CUBIN_DIR`` out of site-packages (see
    the module's docstring); with ``DISTCACHE_OFFLINE=1`` sets
    ``FLASHINFER_NO_DOWNLOAD=1``. Non-collective. Installing again with the same
    arguments returns the same loader; with different ones it replaces the loader.
    ``DISTCACHE_DISABLE=1`` or ``DISTCACHE_FLASHINFER=0`` make it a logged no-op that
    returns ``None``.

    Args:
        pool: the artifact pool.
        origin: where misses come from (default: ``default_origin()`` per call).
        record: a directory; every served ``(name, sha256)`` is appended to this
            process's file there (see :mod:`distcache.integrations.flashinfer._record`).
        families: which names are pooled (default: ``DISTCACHE_FLASHINFER_FAMILIES``,
            else :data:`~distcache.integrations.flashinfer.DEFAULT_POOLED`).

    Raises:
        ConfigError: a bad ``DISTCACHE_*`` value, or FlashInfer is not importable.
    """
    return _PROCESS.install(pool, origin, record, families=families)


def uninstall() -> None:
    """Restore FlashInfer's own ``get_artifact`` everywhere; idempotent."""
    _PROCESS.uninstall()


def uninstall_if(loader: PooledLoader) -> None:
    """:func:`uninstall`, only while ``loader`` is the installed wrapper."""
    _PROCESS.uninstall_if(loader)


def installed() -> PooledLoader | None:
    """The active loader, or ``None``."""
    return _PROCESS.installed()


@atexit.register
def _report_at_exit() -> None:
    loader = _PROCESS.installed()
    if loader is not None:
        _report(loader)
