"""Settings -> pool and settings -> origin, written once for the session and the CLI.

An explicit argument wins, then the ``DISTCACHE_*`` setting, then what an integration
offers (FlashInfer's own repository, say); see ``distcache.config`` for the table of
defaults.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from distcache.config import Settings
from distcache.errors import PoolError

if TYPE_CHECKING:
    from distcache.integrations import Integration
    from distcache.origins import Origin
    from distcache.store import ArtifactPool


def resolve_pool(
    pool: ArtifactPool | str | os.PathLike[str] | None,
    conf: Settings,
    *,
    must_exist: bool = False,
) -> ArtifactPool:
    """The pool to use: ``pool`` when given (an open pool or a directory), else
    ``conf.pool_dir``, capped at ``conf.pool_max_bytes``.

    Raises:
        PoolError: ``must_exist`` and there is no pool at the directory, or the pool
            cannot be opened or created.
    """
    from distcache.store import ArtifactPool

    if isinstance(pool, ArtifactPool):
        return pool
    root = Path(pool) if pool is not None else conf.pool_dir
    if must_exist and not (root / "objects").is_dir():
        raise PoolError(
            f"no pool at {root} (no objects/ directory); pass --pool DIR or set "
            "DISTCACHE_POOL, or create one with 'distcache fetch' or 'distcache pool import'",
            path=str(root),
        )
    return ArtifactPool(root, max_bytes=conf.pool_max_bytes)


def resolve_origin(
    origin: Origin | str | Sequence[str | Origin] | None,
    conf: Settings,
    integrations: Iterable[Integration] = (),
) -> Origin | None:
    """The origin to use: ``origin`` when given, else ``DISTCACHE_ORIGIN``, else the
    first default an integration offers; ``None`` when there is none.

    Raises:
        ConfigError: a spec names an unknown scheme or a directory that is not one.
    """
    from distcache.origins import open_origin

    if origin is not None:
        return open_origin(origin)
    if conf.origins:
        return open_origin(list(conf.origins))
    for integration in integrations:
        spec = integration.default_origin()
        if spec:
            return open_origin(spec)
    return None
