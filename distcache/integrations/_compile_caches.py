"""JIT compile caches in processes an engine starts itself: materialised when the
process starts, published when it exits.

The vLLM plugin and the start-up hook call :func:`start` with the families that
``DISTCACHE_JIT_CACHES`` names (``vllm,inductor``: vLLM's torch.compile cache, and
Inductor's directory with torch's precompiled header), before the engine compiles, and
set each family's variables where unset, as ``init`` does (``triton``:
``TRITON_CACHE_MANAGER``, and ``DISTCACHE_POOL`` to the pool it fills from). The
first process of a tree that has them fills their directories from ``DISTCACHE_POOL``
and becomes their *owner*: it names itself (host, pid, its start time, and a digest of
the families' keys and directories) in :data:`OWNER_VARIABLE` in its own environment,
which the processes it starts inherit (never in a file another process tree on the
host could overwrite or leave stale), and at its exit stores what the directories
gained
(:meth:`distcache.jit.Family.publish`, content-addressed, so the copies that several
ranks hold of one file are one object). A file the engine rewrites at every start
(vLLM on CPU writes each rank's ``model`` anew) is published as an update of this
host's and directory's earlier version, which it supersedes, not as a conflict. A
process whose inherited owner is one of its own ancestors (read from ``/proc``, and
still the process that started then: a reused pid is not), for the same directories
and keys, neither fills nor publishes them again: its owner outlives it
(vLLM's main process waits for its engine core and workers), and the owner's
publication at exit sees every file they built. A process without an owner (a rank
started by ``mpirun``, ``srun`` or ``torchrun``, a node of its own) is its own owner.
Nothing here is collective; nothing raises into the engine.

Publishing hashes every file of the directories, so an owner that changed nothing
(``pip``, ``python -c`` under ``DISTCACHE_AUTOINSTALL=1``) skips it: when the exit
handler is registered it takes a :func:`snapshot` of each family's files (path, size,
modification and change times, inode: by ``stat`` alone), and at exit a family whose
snapshot is the same is not published. A file rewritten with bytes of the same size
moves its change time (and a file renamed into place has another inode), even where
the tool keeps its modification time; a file that was only read changes none of
them. A family whose directories held files the pool's trees do not list (by path and
size) when it was taken is published at exit regardless.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distcache._log import get_logger
from distcache._proc import ancestors, stat_fields

if TYPE_CHECKING:
    from distcache.jit import Family
    from distcache.store._fs import Witness

log = get_logger(__name__)

#: The owner's name in its environment, for the processes it starts:
#: ``<host> <pid> <start time> <digest>``.
OWNER_VARIABLE = "DISTCACHE_JIT_OWNER"
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
    owner = inherited_owner(digest)
    inherited = owner is not None
    summaries = []
    for family in chosen:
        summary: dict[str, Any] = {"name": family.name, "key_id": key_id(family.key),
                                   "owner": owner if owner is not None else os.getpid()}
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
        # As Family.install: before the engine imports the tool (the triton family's
        # cache manager and its pool), inherited by the processes the engine starts.
        family.set_environ(pool)
        summaries.append(summary)
    if not inherited:
        name_owner(digest)
        refused = {s["name"] for s in summaries if "refused" in s}
        armed = {f.name: armed_snapshot(f) for f in chosen if f.name not in refused}
        atexit.register(publish_at_exit, chosen, source, role, os.getpid(), armed)
        log.info("distcache %s hook: JIT caches %s materialised from %s", source,
                 ",".join(f.name for f in chosen), pool_dir)
    return summaries


def started(pid: int) -> str | None:
    """When ``pid`` started (clock ticks after boot, ``/proc``): with the pid, one
    process, never another that reuses the pid later."""
    fields = stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def inherited_owner(digest: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The owner pid :data:`OWNER_VARIABLE` names, when it is an ancestor of this
    process on this host, still the process that named itself (its start time), and
    owns the same families; else ``None``. A copy of the variable outside the owner's
    tree (another job's environment, a container started again) names no ancestor."""
    value = (os.environ if environ is None else environ).get(OWNER_VARIABLE, "")
    try:
        host, pid, began, owned = value.split()
    except ValueError:
        return None
    if host != socket.gethostname() or owned != digest or not (pid.isascii() and pid.isdigit()):
        return None
    return int(pid) if int(pid) in ancestors() and started(int(pid)) == began else None


def name_owner(digest: str) -> None:
    """Name this process the owner of the families ``digest`` stands for, for every
    process it starts from now on (they inherit its environment)."""
    pid = os.getpid()
    os.environ[OWNER_VARIABLE] = f"{socket.gethostname()} {pid} {started(pid) or '-'} {digest}"


#: Path in the family's trees -> the ``stat`` identity of its file
#: (:data:`distcache.store._fs.Witness`: device, inode, size, modification and change
#: times).
Snapshot = dict[str, "Witness"]


def snapshot(family: Family) -> Snapshot:
    """The files of ``family``'s directories that a publication would scan, by
    ``stat`` alone (nothing is read)."""
    from distcache.jit._place import walk
    from distcache.store._fs import witness

    found: Snapshot = {}
    for root in family.spec.roots:
        for rel, path in walk(root.path):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            found[root.prefix + rel] = witness(st)
    return found


def armed_snapshot(family: Family) -> Snapshot | None:
    """:func:`snapshot` of ``family`` when the pool's trees of its key list every file
    it holds with the same size; ``None`` (publish at exit regardless) when they do
    not, or when it cannot be told."""
    from distcache.errors import DistcacheError

    try:
        now = snapshot(family)
        if family.pool is None:
            return None
        known = family.merged()  # the trees its materialisation just read
    except (DistcacheError, OSError) as exc:
        log.debug("%s: no snapshot of its directories: %s", family.name, exc)
        return None
    for path, identity in now.items():
        entry = known.entries.get(path)
        if path not in known.conflicts and (entry is None or entry.size != identity[2]):
            return None
    return now


def publish_at_exit(chosen: list[Family], source: str, role: str, owner: int,
                    armed: Mapping[str, Snapshot | None] | None = None) -> list[dict[str, Any]]:
    """Store what the owner's families gained (a forked child that inherited the exit
    handler publishes nothing) and report it as one ``engine.jit_publish`` event. A
    family whose ``armed`` snapshot still holds is skipped (``unchanged``)."""
    if os.getpid() != owner:
        return []
    from distcache import _events
    from distcache.errors import DistcacheError

    published = []
    for family in chosen:
        row: dict[str, Any] = {"name": family.name}
        began = time.monotonic()
        before = (armed or {}).get(family.name)
        if before is not None and snapshot(family) == before:
            row.update(files=0, unchanged=True, seconds=round(time.monotonic() - began, 3))
            published.append(row)
            continue
        try:
            row["files"] = family.publish()
            row["seconds"] = round(time.monotonic() - began, 3)
        except (DistcacheError, OSError) as exc:
            row["error"] = str(exc)
            log.warning("distcache %s hook: %s not published: %s", source, family.name, exc)
        published.append(row)
    _events.emit("engine.jit_publish", source=source, role=role, families=published)
    return published
