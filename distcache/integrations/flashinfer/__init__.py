"""FlashInfer integration: serve ``get_artifact`` from the distcache pool.

FlashInfer loads kernels lazily through ``flashinfer.jit.cubin_loader.get_artifact
(name, sha256)``; its C++ side reaches it through a ctypes callback that looks the
module attribute up on every call, and a few FlashInfer modules import the function
by name. :func:`install` rebinds every one of those references to a
:class:`PooledLoader`, so a kernel is read from the pool when any rank already has
it, fetched once per pool (single downloader) otherwise, and FlashInfer's own
function is still the fallback for anything distcache cannot serve. FlashInfer's
``download_file`` is rebound too, for the callers that bypass ``get_artifact`` (the
CuTe-DSL FMHA loader fetches its ``checksums.txt`` that way): a file whose sha256
FlashInfer pins is served by the same loader, and offline nothing is downloaded.

distcache's own failures never raise: an exception cannot cross the ctypes callback,
and a callback that returns without handing over bytes leaves FlashInfer's C++ side
holding the previous kernel (see shared/reference/research-flashinfer_cubins.md,
§1.6). On such a failure the loader logs the reason once per artifact and FlashInfer's
own function answers; what that function raises passes through unchanged, as it would
without distcache. ``DISTCACHE_OFFLINE=1`` contacts no origin (FlashInfer's
``FLASHINFER_NO_DOWNLOAD`` is set too), and a "not found" from FlashInfer's own
repository is final. Engines that start their own processes get the wrapper through
``distcache.integrations.vllm`` (a vLLM general plugin) or the opt-in start-up hook
(``DISTCACHE_AUTOINSTALL=1``).

:class:`FlashInfer` is the :class:`~distcache.integrations.Integration` that
``distcache.init`` composes. Importing this package imports neither FlashInfer nor
torch; :func:`install` does.

Behind this front: ``_upstream`` (what is read from FlashInfer: its loader module,
its ``FLASHINFER_*`` variables, the default origin), ``_loader`` (the wrapper's
policy), ``_families`` (which names it pools), ``_download`` (FlashInfer's direct
downloads), ``_record`` (the usage record), ``_install`` (rebinding, the installed
wrapper), ``_integration`` (:class:`FlashInfer`) and ``_warm`` (records and whole
families, prefetched collectively).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distcache.integrations.flashinfer._families import (
    DEFAULT_MATERIALIZED,
    DEFAULT_POOLED,
    Families,
)
from distcache.integrations.flashinfer._install import install, installed, uninstall
from distcache.integrations.flashinfer._integration import FlashInfer
from distcache.integrations.flashinfer._loader import LoaderStats, PooledLoader
from distcache.integrations.flashinfer._upstream import default_origin

if TYPE_CHECKING:
    from distcache.integrations.flashinfer._warm import (
        family_checksums,
        family_manifest,
        family_names,
        prefetch,
    )

#: Loaded on first use: an engine's start-up installs the wrapper, it does not warm
#: whole families.
_WARM = ("family_checksums", "family_manifest", "family_names", "prefetch")

__all__ = [
    "DEFAULT_MATERIALIZED",
    "DEFAULT_POOLED",
    "Families",
    "FlashInfer",
    "LoaderStats",
    "PooledLoader",
    "default_origin",
    "family_checksums",
    "family_manifest",
    "family_names",
    "install",
    "installed",
    "prefetch",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    if name not in _WARM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from distcache.integrations.flashinfer import _warm

    return getattr(_warm, name)
