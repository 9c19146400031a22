"""JIT compile caches through the pool: what one rank builds, every rank and every
later launch uses.

A tool's cache directory (Inductor's, Triton's, DeepGEMM's, FlashInfer's JIT
workspace, vLLM's torch.compile cache) is a *directory family*: its files are stored
as verified, content-addressed objects plus a *tree manifest* (relative path, sha256,
mode, size; FlashInfer's JIT also keeps modification times, for its ninja) under the
family's name and a *key* that captures what makes the files valid elsewhere (tool
and version, Python, platform, and any absolute path the tool bakes in). Identical
files of many ranks are one object.

Enabling families by name::

    session = distcache.init(jit_caches=["inductor", "triton"])   # or
    # DISTCACHE_JIT_CACHES=inductor,triton (carried into spawned workers)
    ...warm-up, torch.compile...
    session.sync()          # publish what every rank built, move it to every pool

At ``init`` each enabled family is an integration: what any pool of the job holds
for it is prefetched with the cubins (one collective, no origin request), then its
directories are filled before the engine compiles. ``Session.sync()`` publishes each
rank's new files (:meth:`Family.publish`) and moves them to every pool.

Without a session (an engine's own worker, a test)::

    from distcache import jit
    fams = jit.families(["vllm"], pool=pool)    # Family objects, this rank's dirs
    jit.materialize(fams)                        # fill the directories (non-collective)
    jit.publish(fams)                            # store what they hold (non-collective)
    fam = jit.family("vllm", pool=pool, environ={"VLLM_CACHE_ROOT": root})

Rules: materialising only adds missing files, each written to a temporary name and
linked into place (never replacing a file a compile may be reading). Each tree names
its *publisher* (the host and the family's directories) and a sequence number: a
file that one publisher rewrites (vLLM on CPU rewrites each rank's ``model`` at every
start) is an update, and its newest version supersedes the older ones, which are no
longer served nor prefetched. Two publishers that give one path different bytes
under one key are a *conflict*: that path is served from neither, and it is logged
once per process. A directory owned by another user is
refused (:class:`~distcache.errors.JitCacheError`). ``TRITON_CACHE_MANAGER=
distcache.jit._triton:PoolCacheManager`` (set by the ``triton`` family) serves
Triton's own cache lookups from the pool of ``DISTCACHE_POOL`` as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from distcache.errors import JitCacheError
from distcache.jit._family import Family, FamilySpec, Report, Root
from distcache.jit._listing import FamilySummary, family_labels, summarize
from distcache.jit._place import Placed
from distcache.jit._tools import TOOLS, spec_for
from distcache.jit._tree import TreeEntry, TreeManifest, family_prefix, key_id, read_trees, union

if TYPE_CHECKING:
    from distcache.store import ArtifactPool

__all__ = [
    "NAMES",
    "Family",
    "FamilySpec",
    "FamilySummary",
    "Placed",
    "Report",
    "Root",
    "TreeEntry",
    "TreeManifest",
    "families",
    "family",
    "family_labels",
    "family_prefix",
    "key_id",
    "materialize",
    "publish",
    "read_trees",
    "summarize",
    "union",
]

_T = TypeVar("_T")

#: The family names ``init(jit_caches=[...])`` and ``DISTCACHE_JIT_CACHES`` accept.
NAMES: tuple[str, ...] = tuple(TOOLS)


def family(name: str, *, pool: ArtifactPool | None = None,
           environ: Mapping[str, str] | None = None, link: bool = False) -> Family:
    """The family ``name`` as this rank sees it (its directories from ``environ``,
    default ``os.environ``).

    Raises:
        ConfigError: ``name`` is not one of :data:`NAMES`.
    """
    return Family(spec_for(name, environ), pool, link=link)


def families(names: Iterable[str], *, pool: ArtifactPool | None = None,
             environ: Mapping[str, str] | None = None, link: bool = False) -> list[Family]:
    """One :class:`Family` per name (repeats dropped, order kept).

    Raises:
        ConfigError: a name is not one of :data:`NAMES`.
    """
    seen: list[str] = []
    for name in names:
        if name not in seen:
            seen.append(name)
    return [family(n, pool=pool, environ=environ, link=link) for n in seen]


def materialize(chosen: Sequence[Family], pool: ArtifactPool | None = None) -> list[Placed]:
    """Fill each family's directories from ``pool`` (default: the family's own);
    not collective. A family whose directory is refused does not keep the others
    from being filled: the first such error is raised once they are.

    Raises:
        JitCacheError: a directory belongs to another user, cannot be created, or its
            filesystem is full or read-only.
        PoolError: the pool cannot be read.
    """
    return _each(chosen, lambda f: f.materialize(pool))


def publish(chosen: Sequence[Family], pool: ArtifactPool | None = None) -> list[int]:
    """Store what each family's directories hold that its trees lack; the number of
    files each new tree lists. Not collective: ``Session.sync()`` (or
    :func:`distcache.collective.sync`) then moves it to the other pools. A family
    whose directory is refused does not keep the others from being stored: the
    first such error is raised once they are.

    Raises:
        JitCacheError: a directory belongs to another user.
        PoolError: the pool cannot be written.
    """
    return _each(chosen, lambda f: f.publish(pool))


def _each(chosen: Sequence[Family], call: Callable[[Family], _T]) -> list[_T]:
    """``call`` on every family; the first :class:`JitCacheError`, raised after all."""
    results: list[_T] = []
    refused: JitCacheError | None = None
    for fam in chosen:
        try:
            results.append(call(fam))
        except JitCacheError as exc:
            refused = refused or exc
    if refused is not None:
        raise refused
    return results
