"""distcache: fetch each kernel artifact once per job, map each IPC pool once.

Public names are re-exported here and loaded on first use, so ``import distcache``
stays cheap and never imports torch or mpi4py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from distcache._version import __version__

_EXPORTS = {
    "Artifact": "distcache.artifact",
    "parse_checksums": "distcache.artifact",
    "ArtifactPool": "distcache.store",
    "HttpOrigin": "distcache.origins",
    "DirOrigin": "distcache.origins",
    "OriginChain": "distcache.origins",
    "prefetch": "distcache.collective",
    "sync": "distcache.collective",
    "PrefetchReport": "distcache.collective",
    "init": "distcache.session",
    "InitOptions": "distcache.session",
    "Session": "distcache.session",
}
_SUBMODULES = ("comm", "errors", "ipc", "integrations", "config")

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:
    from distcache import comm, config, errors, integrations, ipc
    from distcache.artifact import Artifact, parse_checksums
    from distcache.collective import PrefetchReport, prefetch, sync
    from distcache.origins import DirOrigin, HttpOrigin, OriginChain
    from distcache.session import InitOptions, Session, init
    from distcache.store import ArtifactPool


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"distcache.{name}")
    else:
        raise AttributeError(f"module 'distcache' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
