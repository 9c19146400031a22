"""Remove labels and objects from a pool on an operator's request: ``pool rm`` (by
name or glob) and ``pool prune`` (by age).

A removal is planned first (:func:`plan_rm`, :func:`plan_prune`), so a command can
show it, ask, or stop at a dry run, then carried out by :func:`apply`:

- the labels in the plan are dropped from ``names.log``, which is rewritten in place
  under the same ``flock`` that every appender takes, so a label recorded
  concurrently is kept (a crash in the middle can bring removed labels back; rerun the
  command);
- the objects in the plan are deleted. An object is planned only when no label that
  stays points at it, so another name for the same bytes keeps them. A process that
  has the object open keeps reading it; a later lookup is a miss and fetches again.
"""

from __future__ import annotations

import fnmatch
import os
import time
from dataclasses import dataclass, field

from distcache._log import get_logger
from distcache.errors import ConfigError, PoolError
from distcache.store._fs import pool_error
from distcache.store._locking import flock_fd
from distcache.store._log import _name_record
from distcache.store._objects import scan_objects
from distcache.store._pool import ArtifactPool

logger = get_logger(__name__)

_LOCK_WAIT = 30.0


@dataclass
class Removal:
    """What a removal drops: ``labels`` (name -> sha) and ``objects`` (sha -> size).
    ``cutoff`` (a prune's): an object whose recency stamp is no older than this when
    the removal is carried out was used since the plan, and it and its labels stay.
    ``failed``: filled by :func:`apply`, each object it could not delete (sha -> why)."""

    labels: dict[str, str] = field(default_factory=dict)
    objects: dict[str, int] = field(default_factory=dict)
    cutoff: float | None = None
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """Bytes the deleted objects free."""
        return sum(self.objects.values())


def check_glob(pattern: str) -> str:
    """``pattern`` when it is a usable name or glob.

    Raises:
        ConfigError: empty, or an unclosed ``[``.
    """
    if not pattern.strip():
        raise ConfigError("empty name or glob", variable="NAME", value=pattern)
    depth = 0
    for char in pattern:
        if char == "[":
            depth += 1
        elif char == "]" and depth:
            depth -= 1
    if depth:
        raise ConfigError(f"bad glob {pattern!r}: unclosed '['", variable="NAME", value=pattern)
    return pattern


def _sizes(pool: ArtifactPool) -> dict[str, tuple[int, float]]:
    """``sha -> (size, recency stamp)`` of every object present."""
    return {sha: (st.st_size, st.st_mtime) for _p, sha, st in scan_objects(pool.layout)}


def plan_rm(pool: ArtifactPool, patterns: list[str]) -> Removal:
    """The labels whose name matches any of ``patterns`` (``fnmatch``, ``*`` also
    matches ``/``; a plain name matches itself), and the objects only they point at.
    A pattern that is a recorded name is taken as that name first, so a name that
    holds a lone ``[`` is not refused as a bad glob.

    Raises:
        ConfigError: a bad pattern.
        PoolError: the pool cannot be read.
    """
    names = pool.names()
    for pattern in patterns:
        if pattern not in names:  # a recorded name is itself, whatever it holds
            check_glob(pattern)
    dropped = {n: s for n, s in names.items()
               if any(n == p or fnmatch.fnmatchcase(n, p) for p in patterns)}
    kept = {s for n, s in names.items() if n not in dropped}
    present = _sizes(pool)
    objects = {s: present[s][0] for s in set(dropped.values()) - kept if s in present}
    return Removal(labels=dropped, objects=objects)


def plan_prune(pool: ArtifactPool, older_than: float, now: float | None = None) -> Removal:
    """The objects not used for ``older_than`` seconds (their recency stamp, which
    reads refresh), and every label that points at a removed or absent object. A read
    refreshes a stamp only once it is ``pool.stamp_interval`` seconds old, so a stamp
    counts as a use that long before it says.

    Raises:
        PoolError: the pool cannot be read.
    """
    cutoff = (time.time() if now is None else now) - older_than - pool.stamp_interval
    present = _sizes(pool)
    objects = {s: size for s, (size, stamp) in present.items() if stamp < cutoff}
    labels = {n: s for n, s in pool.names().items() if s in objects or s not in present}
    return Removal(labels=labels, objects=objects, cutoff=cutoff)


def _used_since(pool: ArtifactPool, removal: Removal) -> set[str]:
    """The planned objects whose recency stamp moved to ``removal.cutoff`` or later."""
    if removal.cutoff is None:
        return set()
    used = set()
    for sha in removal.objects:
        try:
            if os.lstat(pool.layout.object_path(sha)).st_mtime >= removal.cutoff:
                used.add(sha)
        except OSError:
            continue
    return used


def _rewrite_labels(pool: ArtifactPool, dropped: dict[str, str]) -> tuple[int, dict[str, str]]:
    """Rewrite ``names.log`` without the ``dropped`` labels; how many were dropped, and
    the labels that stay.

    Raises:
        PoolError: the log cannot be rewritten, or an appender held it past the wait.
    """
    path = pool.layout.names_log
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0, {}
    except OSError as exc:
        raise pool_error("cannot open", path, exc) from exc
    try:
        if flock_fd(fd, _LOCK_WAIT, path=str(path)) is False:
            # Rewriting beside an appender would lose the label it records.
            raise PoolError(f"cannot rewrite {path}: another process held it locked for "
                            f"{_LOCK_WAIT:g}s; run the command again", path=str(path))
        # Under the lock no appender writes: this is every label.
        current = pool.names()
        keep = {n: s for n, s in current.items() if dropped.get(n) != s}
        data = "".join(f"\n{_name_record(n, s)}\n" for n, s in keep.items()).encode()
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        return len(current) - len(keep), keep
    except PoolError:
        raise
    except OSError as exc:
        raise pool_error("cannot rewrite", path, exc) from exc
    finally:
        os.close(fd)


def apply(pool: ArtifactPool, removal: Removal) -> tuple[int, int, int]:
    """Carry out ``removal``; returns ``(labels dropped, objects deleted, bytes freed)``.
    Each object that could not be deleted (a read-only pool, a directory this user
    cannot write) is logged and recorded in ``removal.failed``.

    Raises:
        PoolError: the label log cannot be rewritten.
    """
    failed = removal.failed
    failed.clear()
    used = _used_since(pool, removal)
    if used:
        removal = Removal(labels={n: s for n, s in removal.labels.items() if s not in used},
                          objects={s: n for s, n in removal.objects.items() if s not in used})
    if removal.labels:
        labels, kept = _rewrite_labels(pool, removal.labels)
    else:
        labels, kept = 0, pool.names()
    # A label recorded since the plan (another name for the same bytes) keeps them.
    wanted = set(kept.values())
    deleted = freed = 0
    for sha, size in removal.objects.items():
        if sha in wanted:
            continue
        try:
            os.unlink(pool.layout.object_path(sha))
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot remove object %s from %s: %s", sha, pool.root, exc)
            failed[sha] = exc.strerror or str(exc)
            continue
        deleted += 1
        freed += size
    logger.info("removed %d labels and %d objects (%d bytes) from %s", labels, deleted, freed,
                pool.root)
    return labels, deleted, freed
