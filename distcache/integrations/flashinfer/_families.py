"""Which artifact names the loader wrapper serves from the pool, and which of those
it also writes as files into FlashInfer's cubin directory."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import NamedTuple

from distcache.config import Settings, settings

#: Pooled by default: every kernel (``.cubin``; cute-dsl ``.so``) and the files FlashInfer
#: fetches to compile against them, all content-addressed by the sha256 FlashInfer passes.
DEFAULT_POOLED = ("*.cubin", "*.so", "*.h", "*/checksums.txt", "*.json")
#: Also written into ``FLASHINFER_CUBIN_DIR`` by default: the files FlashInfer (or nvcc,
#: through its include symlinks) opens by path; TRTLLM-Gen/cuDNN cubins are only handed
#: over as bytes, so they are not copied into every rank's cache.
DEFAULT_MATERIALIZED = ("*.h", "*/checksums.txt", "*.json", "*.so", "*/deep-gemm/*")


class Families(NamedTuple):
    """Which artifact names the loader serves from the pool (shell globs, matched
    against the whole normalised name; ``*`` also matches ``/``, so a pin prefix is
    ``"<pin>/fmha/trtllm-gen/*"``)."""

    #: Names served from the pool; anything else goes straight to FlashInfer.
    pooled: tuple[str, ...] = DEFAULT_POOLED
    #: Names never pooled, even when ``pooled`` matches.
    excluded: tuple[str, ...] = ()
    #: Pooled names that must also exist as files under ``FLASHINFER_CUBIN_DIR``.
    materialized: tuple[str, ...] = DEFAULT_MATERIALIZED

    def is_pooled(self, name: str) -> bool:
        return _matches(name, self.pooled) and not _matches(name, self.excluded)

    def is_materialized(self, name: str) -> bool:
        return _matches(name, self.materialized)

    @classmethod
    def from_settings(cls, conf: Settings | None = None) -> Families:
        """``DISTCACHE_FLASHINFER_FAMILIES`` (comma-separated globs) replaces
        :data:`DEFAULT_POOLED` when set.

        Raises:
            ConfigError: the variable is set but lists no glob.
        """
        globs = (conf if conf is not None else settings()).flashinfer_families
        return cls() if globs is None else cls(pooled=globs)


def _matches(name: str, globs: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, g) for g in globs)
