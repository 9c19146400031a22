"""``FlashInfer``: the :class:`~distcache.integrations.Integration` that
``distcache.init`` composes for FlashInfer's kernel loader."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from distcache.artifact import Artifact
from distcache.config import settings
from distcache.integrations.flashinfer._families import Families
from distcache.integrations.flashinfer._install import install, uninstall_if
from distcache.integrations.flashinfer._loader import PooledLoader
from distcache.integrations.flashinfer._record import read_record, recorded_ns
from distcache.integrations.flashinfer._upstream import (
    LOADER_MODULE,
    REPOSITORY_VARIABLE,
    available,
    cubin_dir,
    loader_attr,
    repository,
)

if TYPE_CHECKING:
    from distcache.origins import Origin
    from distcache.store import ArtifactPool


class FlashInfer:
    """FlashInfer's loader, served from the pool.

    Args:
        record: a usage-record directory: :meth:`manifest` lists what it holds (what
            earlier runs asked for), and the installed wrapper appends to it.
        families: which names the wrapper pools (default:
            ``DISTCACHE_FLASHINFER_FAMILIES``, else ``DEFAULT_POOLED``).
    """

    name = "flashinfer"

    @property
    def install_beside_prefetch(self) -> bool:
        """Whether ``init`` may install this while its prefetch runs, on a thread (see
        :mod:`distcache._beside`): the install puts a wrapper in front of FlashInfer's
        loader and reads nothing the prefetch brings. Not offline, where it sets
        ``FLASHINFER_NO_DOWNLOAD`` (the process's environment is not changed beside
        running threads), nor where it would import FlashInfer with
        ``FLASHINFER_LOGLEVEL`` at 10 or more (that import installs a SIGTERM handler,
        which only the main thread can)."""
        if settings().offline:
            return False
        if LOADER_MODULE in sys.modules:
            return True
        try:
            return int(os.environ.get("FLASHINFER_LOGLEVEL", "0").strip() or "0") < 10
        except ValueError:  # FlashInfer's import raises on it: on the main thread
            return False

    def __init__(
        self,
        record: str | os.PathLike[str] | None = None,
        *,
        families: Families | None = None,
    ) -> None:
        self.record = record
        self.families = families
        self._loader: PooledLoader | None = None

    def __repr__(self) -> str:
        return f"FlashInfer(record={self.record!r})"

    def available(self) -> bool:
        """True when FlashInfer is importable (it is not imported to find out)."""
        return available()

    def default_origin(self) -> str | None:
        """``$FLASHINFER_CUBINS_REPOSITORY``; else, when a usage record is to be
        prefetched, FlashInfer's own repository (its loader is imported only then: it
        costs seconds); else ``None``, and the wrapper asks FlashInfer's loader for its
        repository at each miss."""
        repo = repository()
        if repo is None and self.record is not None and available():
            builtin = loader_attr(REPOSITORY_VARIABLE)
            repo = str(builtin) if builtin else None
        return repo

    def manifest(self) -> list[Artifact]:
        """What the usage record lists (empty without a record directory).

        Raises:
            ManifestError: a malformed record, or a name recorded with two digests.
            ArtifactNameError: a recorded name is unsafe.
            PoolError: the record directory cannot be read.
        """
        if self.record is None:
            return []
        return [Artifact(n, s) for n, s in sorted(read_record(self.record).items())]

    def recorded_ns(self) -> int | None:
        """When the usage record was last written (ns), to date it against other
        nodes' records; ``None`` without one."""
        return None if self.record is None else recorded_ns(self.record)

    def install(self, pool: ArtifactPool, origin: Origin | None) -> None:
        """Serve FlashInfer's ``get_artifact`` from ``pool`` (see
        :func:`distcache.integrations.flashinfer.install`).

        Raises:
            ConfigError: a bad ``DISTCACHE_*`` value, or FlashInfer is not importable.
        """
        self._loader = install(pool, origin, self.record, families=self.families)

    def uninstall(self) -> None:
        """Restore FlashInfer's own function if this integration's wrapper is the one
        installed; idempotent."""
        if self._loader is not None:
            uninstall_if(self._loader)
            self._loader = None

    def materialize_dir(self) -> Path | None:
        """Where FlashInfer reads ``<dir>/<name>``: its loader's ``FLASHINFER_CUBIN_DIR``
        when loaded, else ``$FLASHINFER_CUBIN_DIR``, else ``None``."""
        return cubin_dir()
