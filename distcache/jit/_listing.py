"""What a pool holds for its directory families, for ``distcache pool ls --family``
and ``pool export --family``."""

from __future__ import annotations

from dataclasses import dataclass

from distcache.artifact import Artifact
from distcache.errors import JitCacheError
from distcache.jit._tree import PREFIX, TreeManifest, key_id, tree_bytes, union
from distcache.store import ArtifactPool


@dataclass(frozen=True, slots=True)
class FamilySummary:
    """One family under one key, as a pool holds it."""

    family: str
    key: str
    key_id: str
    trees: int
    files: int
    bytes: int
    conflicts: int
    #: Files listed whose object this pool lacks.
    absent: int


def family_labels(pool: ArtifactPool, families: tuple[str, ...] = ()) -> list[Artifact]:
    """The labels of ``families`` (every family when empty) whose object is present."""
    prefixes = tuple(f"{PREFIX}{f}/" for f in families) or (PREFIX,)
    return [Artifact(n, s) for n, s in sorted(pool.names().items())
            if n.startswith(prefixes) and pool.has(s)]


def summarize(pool: ArtifactPool, families: tuple[str, ...] = ()) -> list[FamilySummary]:
    """One summary per family and key the pool holds trees for (``families``: only
    those), sorted by family and key."""
    grouped: dict[tuple[str, str], list[TreeManifest]] = {}
    for label in family_labels(pool, families):
        parts = label.name.split("/")
        if len(parts) != 5 or parts[3] != "tree":
            continue
        data = tree_bytes(pool, label.sha256)
        if data is None:
            continue
        try:
            tree = TreeManifest.decode(data)
        except JitCacheError:
            continue
        if tree.family == parts[1] and key_id(tree.key) == parts[2]:
            grouped.setdefault((parts[1], parts[2]), []).append(tree)
    out = []
    for (family, kid), trees in sorted(grouped.items()):
        merged = union(trees)
        entries = merged.entries.values()
        out.append(FamilySummary(
            family=family, key=trees[0].key, key_id=kid, trees=len(trees),
            files=len(merged.entries), bytes=sum(e.size for e in entries),
            conflicts=len(merged.conflicts),
            absent=sum(not pool.has(e.sha256) for e in entries)))
    return out
