"""Triton's cache behind the pool: ``TRITON_CACHE_MANAGER=
distcache.jit._triton:PoolCacheManager``.

The manager is Triton's own :class:`~triton.runtime.cache.FileCacheManager` (files in
``TRITON_CACHE_DIR``, written atomically by Triton) with the pool behind it: a file or
group the directory lacks is looked up in the ``triton`` family's trees of the pool at
``DISTCACHE_POOL`` and materialised (verified; a corrupt object is a miss), and every
group Triton puts (a compiled kernel: its files and the group file naming them) is
published as one tree, so that ``Session.sync()`` moves it to every pool. Under
``DISTCACHE_DISABLE=1`` it is Triton's own file cache and nothing more. Files keep
Triton's layout (``<key>/<file>``), so the directory family and the manager share
their trees. Importing this module imports Triton.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from triton.runtime.cache import FileCacheManager

from distcache._log import get_logger
from distcache.config import settings
from distcache.errors import DistcacheError
from distcache.jit._family import Family, FamilySpec, Root
from distcache.jit._place import materialize_entries, scan_into
from distcache.jit._tools import triton as triton_spec
from distcache.jit._tree import (
    ConflictLog,
    TreeEntry,
    TreeManifest,
    publish_tree,
    read_trees,
    union,
)
from distcache.jit._walk import check_way
from distcache.store import ArtifactPool

log = get_logger(__name__)

# One pool and one conflict log per process: Triton builds a manager per lookup.
_LOCK = threading.Lock()
_POOLS: dict[str, ArtifactPool] = {}
_CONFLICTS = ConflictLog()
# Trees read, by digest (immutable): a compile's every miss does not read them again.
_TREES: dict[str, TreeManifest] = {}


def _pool() -> ArtifactPool | None:
    """The pool of ``DISTCACHE_POOL``, one per process; ``None`` under
    ``DISTCACHE_DISABLE=1`` (the manager is then Triton's own file cache: no pool is
    made, read or written) or when there is none to open."""
    try:
        conf = settings()
        if conf.disable:
            return None
        root = str(conf.pool_dir)
        with _LOCK:
            if root not in _POOLS:
                _POOLS[root] = ArtifactPool(root, max_bytes=conf.pool_max_bytes)
            return _POOLS[root]
    except (DistcacheError, OSError) as exc:
        log.warning("triton: no pool behind the cache (%s); Triton's own cache only", exc)
        return None


class PoolCacheManager(FileCacheManager):
    """Triton's file cache, filled from and published to the pool."""

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        super().__init__(key, override=override, dump=dump)
        self._family: Family | None = None
        if not (override or dump):
            pool = _pool()
            if pool is not None:
                root = Path(self.cache_dir).parent
                spec = triton_spec({**os.environ, "TRITON_CACHE_DIR": str(root)})
                self._family = Family(FamilySpec(spec.name, spec.key, (Root(root),)), pool)

    def get_file(self, filename: str) -> str | None:
        found: str | None = super().get_file(filename)
        if found is None and self._fill([filename]):
            found = super().get_file(filename)
        return found

    def get_group(self, filename: str) -> dict[str, str] | None:
        group = f"__grp__{filename}"
        if not self.has_file(group):
            self._fill([group])
        path = self._make_path(group)
        try:
            with open(path) as f:
                children = json.load(f).get("child_paths") or {}
        except (OSError, ValueError, AttributeError):
            children = {}
        wanted = [os.path.basename(p) for p in children.values()
                  if isinstance(p, str) and not os.path.exists(p)]
        if wanted:
            self._fill(wanted)
        result: dict[str, str] | None = super().get_group(filename)
        return result

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        path: str = super().put_group(filename, group)
        if self._family is not None:
            self._publish([f"__grp__{filename}", *(os.path.basename(p) for p in group.values())])
        return path

    # -- the pool ----------------------------------------------------------------

    def _entries(self) -> dict[str, TreeEntry]:
        family = self._family
        assert family is not None and family.pool is not None
        with _LOCK:
            trees = read_trees(family.pool, family.name, family.key, cache=_TREES)
        merged = union(trees)
        _CONFLICTS.report(family.name, family.key, merged.conflicts)
        return merged.entries

    def _fill(self, filenames: list[str]) -> bool:
        """Materialise ``filenames`` of this key from the pool; whether all arrived."""
        family = self._family
        if family is None or family.pool is None:
            return False
        try:
            entries = self._entries()
            chosen = [entries.get(f"{self.key}/{name}") for name in filenames]
            if any(e is None for e in chosen):
                return False
            placed = materialize_entries(family.pool, Path(self.cache_dir).parent,
                                         [e for e in chosen if e is not None],
                                         family=family.name)
        except (DistcacheError, OSError) as exc:
            log.warning("triton: cannot fill %s from the pool: %s", self.key, exc)
            return False
        return placed.missing == 0 and placed.kept == 0

    def _publish(self, filenames: list[str]) -> None:
        """Store the named files of this key as one tree."""
        family = self._family
        assert family is not None and family.pool is not None
        try:
            names = set(filenames)
            # Refused (logged below) where another user could have planted the files.
            check_way(Path(self.cache_dir), family=family.name)
            with family.pool.batch():  # the files and their tree, collected as one
                entries = [e for e in scan_into(family.pool, Path(self.cache_dir),
                                                f"{self.key}/")
                           if e.path.split("/", 1)[1] in names]
                publish_tree(family.pool,
                             TreeManifest(family.name, family.key, tuple(entries)))
        except (DistcacheError, OSError) as exc:
            log.warning("triton: cannot publish %s to the pool: %s", self.key, exc)
