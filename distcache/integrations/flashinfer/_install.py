"""Putting the loader wrapper into FlashInfer and taking it out again.

FlashInfer's C++ side reaches ``get_artifact`` through a ctypes callback that looks
the module attribute up on every call, and a few FlashInfer modules import the
function by name, so :func:`install` rebinds every one of those references. The
installed wrapper is the process's one piece of integration state: FlashInfer has one
loader per process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distcache.config import settings
from distcache.integrations.flashinfer._loader import Families, GetArtifact, PooledLoader
from distcache.integrations.flashinfer._record import Recorder
from distcache.integrations.flashinfer._upstream import LOADER_MODULE, cubin_dir, loader_module

if TYPE_CHECKING:
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = logging.getLogger(__name__)


@dataclass
class _Installation:
    loader: PooledLoader
    original: GetArtifact
    key: tuple[int, int, str | None, Families]


_installed: _Installation | None = None
_install_lock = threading.Lock()


def _flashinfer_modules() -> list[Any]:
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and (name == "flashinfer" or name.startswith("flashinfer."))
    ]


def _rebind(old: object, new: object) -> list[str]:
    changed = []
    for module in _flashinfer_modules():
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                changed.append(f"{module.__name__}.{attr}")
    return changed


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
    :class:`PooledLoader`. Installing again with the same arguments returns the same
    loader; with different ones it replaces the loader. ``DISTCACHE_DISABLE=1`` or
    ``DISTCACHE_FLASHINFER=0`` make it a logged no-op that returns ``None``.

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
    global _installed
    conf = settings()
    if conf.disable or not conf.flashinfer:
        log.info("flashinfer integration disabled (DISTCACHE_DISABLE / DISTCACHE_FLASHINFER)")
        return None
    fams = families if families is not None else Families.from_settings(conf)
    key = (id(pool), id(origin), os.fspath(record) if record is not None else None, fams)
    loader_module()  # imports FlashInfer, or raises ConfigError
    with _install_lock:
        if _installed is not None:
            if _installed.key == key:
                return _installed.loader
            _uninstall_locked()
        original: GetArtifact = sys.modules[LOADER_MODULE].get_artifact
        loader = PooledLoader(
            pool,
            original,
            origin=origin,
            cubin_dir=cubin_dir,
            families=fams,
            recorder=Recorder(record) if record is not None else None,
        )
        changed = _rebind(original, loader)
        _installed = _Installation(loader=loader, original=original, key=key)
    log.info("flashinfer: get_artifact served from pool %s (rebound %s)",
             getattr(pool, "root", pool), ", ".join(changed))
    return loader


def _uninstall_locked() -> None:
    global _installed
    if _installed is None:
        return
    # Modules imported after install() copied the loader; they are restored too.
    _rebind(_installed.loader, _installed.original)
    if _installed.loader.recorder is not None:
        _installed.loader.recorder.close()
    _installed = None


def uninstall() -> None:
    """Restore FlashInfer's own ``get_artifact`` everywhere; idempotent."""
    with _install_lock:
        _uninstall_locked()


def uninstall_if(loader: PooledLoader) -> None:
    """:func:`uninstall`, only while ``loader`` is the installed wrapper."""
    with _install_lock:
        if _installed is not None and _installed.loader is loader:
            _uninstall_locked()


def installed() -> PooledLoader | None:
    """The active loader, or ``None``."""
    return _installed.loader if _installed is not None else None
