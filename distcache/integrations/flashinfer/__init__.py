"""FlashInfer integration: serve ``get_artifact`` from the distcache pool.

FlashInfer loads kernels lazily through ``flashinfer.jit.cubin_loader.get_artifact
(name, sha256)``; its C++ side reaches it through a ctypes callback that looks the
module attribute up on every call, and a few FlashInfer modules import the function
by name. :func:`install` rebinds every one of those references to a
:class:`PooledLoader`, so a kernel is read from the pool when any rank already has
it, fetched once per pool (single downloader) otherwise, and FlashInfer's own
function is still the fallback for anything distcache cannot serve.

The loader never raises: an exception cannot cross the ctypes callback, and a
callback that returns without handing over bytes leaves FlashInfer's C++ side holding
the previous kernel (see shared/reference/research-flashinfer_cubins.md, §1.6). On
any failure it logs the reason once per artifact and returns what FlashInfer's own
function returns, or ``b""``.

Importing this module imports neither FlashInfer nor torch; :func:`install` does.

The loader's policy is in :mod:`distcache.integrations.flashinfer._loader`, the
usage record in :mod:`distcache.integrations.flashinfer._record`, and the collective
side (merging records, warming whole families) in
:mod:`distcache.integrations.flashinfer._warm`; their public names are re-exported here.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distcache.artifact import Artifact
from distcache.config import env_bool
from distcache.errors import ConfigError
from distcache.integrations.flashinfer._loader import (
    DEFAULT_MATERIALIZED,
    DEFAULT_POOLED,
    Families,
    GetArtifact,
    LoaderStats,
    PooledLoader,
)
from distcache.integrations.flashinfer._record import Recorder

if TYPE_CHECKING:
    from distcache.collective._core import PrefetchReport
    from distcache.origins._origin import Origin
    from distcache.store._pool import ArtifactPool

__all__ = [
    "DEFAULT_MATERIALIZED",
    "DEFAULT_POOLED",
    "Families",
    "LoaderStats",
    "PooledLoader",
    "default_origin",
    "family_manifest",
    "install",
    "installed",
    "prefetch",
    "uninstall",
]

log = logging.getLogger(__name__)

LOADER_MODULE = "flashinfer.jit.cubin_loader"


# --- origin -------------------------------------------------------------------------

_origins: dict[tuple[str, ...], Origin] = {}
_origins_lock = threading.Lock()


def default_origin() -> Origin:
    """The origin a pool miss is fetched from, resolved now:
    ``DISTCACHE_ORIGIN``, else ``$FLASHINFER_CUBINS_REPOSITORY``, else FlashInfer's
    ``cubin_loader.FLASHINFER_CUBINS_REPOSITORY`` (its built-in default, or what a
    program assigned to it).

    Raises:
        ConfigError: none of them is set and FlashInfer is not importable.
    """
    from distcache.config import settings
    from distcache.origins._origin import open_origin

    specs = settings().origins
    if not specs:
        repo = os.environ.get("FLASHINFER_CUBINS_REPOSITORY") or _loader_attr(
            "FLASHINFER_CUBINS_REPOSITORY"
        )
        if not repo:
            raise ConfigError(
                "no origin: set DISTCACHE_ORIGIN or FLASHINFER_CUBINS_REPOSITORY",
                variable="DISTCACHE_ORIGIN",
                value=None,
            )
        specs = (str(repo),)
    with _origins_lock:
        origin = _origins.get(specs)
        if origin is None:
            origin = open_origin(list(specs) if len(specs) > 1 else specs[0])
            _origins[specs] = origin
        return origin


def _loader_attr(attr: str) -> Any:
    module = sys.modules.get(LOADER_MODULE)
    if module is None:
        try:
            import flashinfer.jit.cubin_loader as module
        except Exception as exc:
            raise ConfigError(
                f"FlashInfer is not importable ({type(exc).__name__}: {exc}); install "
                "flashinfer-python or set DISTCACHE_FLASHINFER=0",
                variable="DISTCACHE_FLASHINFER",
                value=None,
            ) from exc
    return getattr(module, attr, None)


def _cubin_dir() -> Path | None:
    value = getattr(sys.modules.get(LOADER_MODULE), "FLASHINFER_CUBIN_DIR", None)
    return Path(value) if value is not None else None


# --- install ------------------------------------------------------------------------


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
        origin: where misses come from (default: :func:`default_origin` per call).
        record: a directory; every served ``(name, sha256)`` is appended to this
            process's file there (see :mod:`distcache.integrations.flashinfer._record`).
        families: which names are pooled (default: ``DISTCACHE_FLASHINFER_FAMILIES``,
            else :data:`DEFAULT_POOLED`).

    Raises:
        ConfigError: a bad ``DISTCACHE_*`` value, or FlashInfer is not importable.
    """
    global _installed
    if env_bool("DISTCACHE_DISABLE", False) or not env_bool("DISTCACHE_FLASHINFER", True):
        log.info("flashinfer integration disabled (DISTCACHE_DISABLE / DISTCACHE_FLASHINFER)")
        return None
    fams = families if families is not None else Families.from_env()
    key = (id(pool), id(origin), os.fspath(record) if record is not None else None, fams)
    _loader_attr("get_artifact")  # imports FlashInfer, or raises ConfigError
    with _install_lock:
        if _installed is not None:
            if _installed.key == key:
                return _installed.loader
            _uninstall_locked()
        loader_module = sys.modules[LOADER_MODULE]
        original: GetArtifact = loader_module.get_artifact
        loader = PooledLoader(
            pool,
            original,
            origin=origin,
            cubin_dir=_cubin_dir,
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


def installed() -> PooledLoader | None:
    """The active loader, or ``None``."""
    return _installed.loader if _installed is not None else None


# --- collective side (re-exported) --------------------------------------------------


def prefetch(**kwargs: Any) -> PrefetchReport:
    """See :func:`distcache.integrations.flashinfer._warm.prefetch`."""
    from distcache.integrations.flashinfer._warm import prefetch as _prefetch

    return _prefetch(**kwargs)


def family_manifest(family: str, origin: Origin | None = None, **kwargs: Any) -> list[Artifact]:
    """See :func:`distcache.integrations.flashinfer._warm.family_manifest`."""
    from distcache.integrations.flashinfer._warm import family_manifest as _family_manifest

    return _family_manifest(family, origin, **kwargs)
