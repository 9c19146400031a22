"""JIT compile caches in processes an engine starts itself: materialised when the
process starts, published when it exits.

The vLLM plugin and the start-up hook call :func:`start` with the families that
``DISTCACHE_JIT_CACHES`` names (``vllm,inductor``: vLLM's torch.compile cache, and
Inductor's directory with torch's precompiled header), before the engine compiles. The
first process of a tree that has them fills their directories from ``DISTCACHE_POOL``
and becomes their *owner*: it records itself in :data:`OWNER` (inherited by every
process it starts), and at its exit stores what the directories gained
(:meth:`distcache.jit.Family.publish`, content-addressed, so the copies that several
ranks hold of one file are one object). A process that inherits an owner for the same
directories and keys neither fills nor publishes them again: its owner outlives it
(vLLM's main process waits for its engine core and workers), and the owner's
publication at exit sees every file they built. A process without an owner (a rank
started by ``mpirun``, ``srun`` or ``torchrun``, a node of its own) is its own owner.
Nothing here is collective; nothing raises into the engine.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distcache.jit import Family

log = logging.getLogger(__name__)

#: Set by the owning process to ``<pid>:<digest of the families' keys and roots>``.
OWNER = "DISTCACHE_JIT_OWNER"

_lock = threading.Lock()
# pid -> the families this process started (and, when it owns them, publishes).
_started: dict[int, list[dict[str, Any]]] = {}


def _digest(families: list[Family]) -> str:
    text = repr([(f.name, f.key, [(str(r.path), r.prefix) for r in f.spec.roots])
                 for f in families])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def start(source: str, role: str) -> list[dict[str, Any]]:
    """Materialise the families of ``DISTCACHE_JIT_CACHES`` in this process unless an
    owner already did, and publish them at exit when this process is their owner.
    ``role`` names the process in the exit's ``engine.jit_publish`` event.

    Returns:
        One summary per family for the process's ``engine.hook`` event: ``name``,
        ``key_id``, ``owner`` (the owning pid), ``written``/``present``/``missing``
        files, ``bytes`` written and ``seconds`` taken (absent when the owner
        materialised), ``refused``
        when a directory was refused. Empty when none is enabled. Never raises.
    """
    pid = os.getpid()
    with _lock:
        if pid in _started:
            return _started[pid]
    try:
        from distcache.config import settings

        conf = settings()
        if conf.disable or not conf.jit_caches:
            summaries: list[dict[str, Any]] = []
        else:
            summaries = _start(source, role, conf.jit_caches, conf.pool_dir,
                               conf.pool_max_bytes)
    except Exception as exc:
        log.warning("distcache %s hook: JIT caches not materialised: %s: %s", source,
                    type(exc).__name__, exc)
        summaries = [{"error": f"{type(exc).__name__}: {exc}"}]
    with _lock:
        _started[pid] = summaries
    return summaries


def _start(source: str, role: str, names: tuple[str, ...],
           pool_dir: os.PathLike[str] | str, max_bytes: int | None) -> list[dict[str, Any]]:
    from distcache.errors import DistcacheError
    from distcache.jit import families, key_id
    from distcache.store import ArtifactPool

    pool = ArtifactPool(pool_dir, max_bytes=max_bytes)
    chosen = families(names, pool=pool)
    digest = _digest(chosen)
    owner_pid, _, owner_digest = os.environ.get(OWNER, "").partition(":")
    inherited = owner_digest == digest and owner_pid.isdigit() and int(owner_pid) != os.getpid()
    summaries = []
    for family in chosen:
        summary: dict[str, Any] = {"name": family.name, "key_id": key_id(family.key),
                                   "owner": int(owner_pid) if inherited else os.getpid()}
        if not inherited:
            began = time.monotonic()
            try:
                placed = family.materialize()
                summary.update(written=placed.written, present=placed.present,
                               missing=placed.missing, bytes=placed.bytes,
                               conflicts=family.report.conflicts,
                               seconds=round(time.monotonic() - began, 3))
            except (DistcacheError, OSError) as exc:
                summary["refused"] = str(exc)
                log.warning("distcache %s hook: %s not materialised: %s", source,
                            family.name, exc)
        summaries.append(summary)
    if not inherited:
        os.environ[OWNER] = f"{os.getpid()}:{digest}"
        atexit.register(publish_at_exit, chosen, source, role, os.getpid())
        log.info("distcache %s hook: JIT caches %s materialised from %s", source,
                 ",".join(f.name for f in chosen), pool_dir)
    return summaries


def publish_at_exit(chosen: list[Family], source: str, role: str,
                    owner: int) -> list[dict[str, Any]]:
    """Store what the owner's families gained (a forked child that inherited the exit
    handler publishes nothing) and report it as one ``engine.jit_publish`` event."""
    if os.getpid() != owner:
        return []
    from distcache import _events
    from distcache.errors import DistcacheError

    published = []
    for family in chosen:
        row: dict[str, Any] = {"name": family.name}
        began = time.monotonic()
        try:
            row["files"] = family.publish()
            row["seconds"] = round(time.monotonic() - began, 3)
        except (DistcacheError, OSError) as exc:
            row["error"] = str(exc)
            log.warning("distcache %s hook: %s not published: %s", source, family.name, exc)
        published.append(row)
    _events.emit("engine.jit_publish", source=source, role=role, families=published)
    return published
