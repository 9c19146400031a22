"""Before the start-up prefetch's collectives: what decides a rank's prefetch
(:func:`inputs_key`), and setting up the origin's client ahead of the first download.

An HTTP origin imports its client stack and builds its session on the first request:
tens of milliseconds of CPU on the ranks that download, which the fetch phase would
wait for. Between the moment a rank knows it may download and the fetch phase, the
start-up runs rounds of small collectives that mostly wait on the other ranks; the
set-up runs on a thread meanwhile. It is started only on a rank that may download
(a node leader the plan may give downloads to, or every rank where no leader acts for
its node) and only when its pool lacks something listed (a warm start sets nothing
up), and it never raises: the download reports what went wrong.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distcache._log import get_logger
from distcache.artifact import MAX_MANIFEST_BYTES, Artifact, manifest_text, merge_manifests
from distcache.comm import Communicator, NodeTree, node_tree
from distcache.config import Settings, settings
from distcache.errors import ConfigError, DistcacheError

if TYPE_CHECKING:
    from distcache.integrations import Integration
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = get_logger(__name__)


#: Entries of each manifest :func:`lacks_any` looks up in the pool, spread over it.
SAMPLE = 16


def lacks_any(pool: ArtifactPool, manifests: Sequence[Any],
              integrations: Sequence[Integration]) -> bool:
    """Whether ``pool`` may need a download: it lacks one of :data:`SAMPLE` entries
    spread over each manifest (a start-up whose pool is cold lacks the first it looks
    up; a warm one is looked up :data:`SAMPLE` times, not once per artifact, and the
    manifest is not parsed twice), or integrations are given (what they want is read
    later, from every rank). A manifest that cannot be read counts as lacking: the
    prefetch reports it. A pool that lacks only entries outside the sample is
    prefetched all the same, its client set up by the first download."""
    if integrations:
        return True
    for spec in manifests:
        try:
            if isinstance(spec, str | os.PathLike):
                lines = [line for line in _manifest_bytes(spec).splitlines()
                         if line.strip() and not line.lstrip().startswith(b"#")]
                shas = [line.split()[0].decode("ascii").lower() for line in _spread(lines)]
            else:
                shas = [a.sha256 for a in _spread(list(spec))]
            if not all(pool.holding(shas)):
                return True
        except (OSError, ValueError, AttributeError, IndexError):
            return True  # unreadable or malformed: the prefetch says how
    return False


def _spread(entries: list[Any]) -> list[Any]:
    """At most :data:`SAMPLE` of ``entries``, evenly spaced, the first and last among them."""
    if len(entries) <= SAMPLE:
        return entries
    step = (len(entries) - 1) / (SAMPLE - 1)
    return [entries[round(i * step)] for i in range(SAMPLE)]


def prepare_in_background(origin: Origin | None, pool: ArtifactPool,
                          manifests: Sequence[Any],
                          integrations: Sequence[Integration]) -> threading.Thread | None:
    """Start ``origin.prepare()`` on a daemon thread when ``pool`` lacks something
    listed (:func:`lacks_any`); the thread, else None."""
    prepare = getattr(origin, "prepare", None)
    if prepare is None or not lacks_any(pool, manifests, integrations):
        return None

    def run() -> None:
        try:
            prepare()
        except Exception as exc:  # the first download meets it again and reports it
            log.debug("setting up %s ahead of the downloads failed: %s", origin, exc)

    thread = threading.Thread(target=run, daemon=True, name="distcache-origin-setup")
    thread.start()
    return thread


#: The shape of ``manifests``, for the messages that refuse another.
_SHAPE = ("a list of manifests, each the path of a sha256sum-format file or a list of "
          "Artifact (manifests=['checksums.txt'] or manifests=[read_manifest(M)])")


def check_manifests(manifests: Any) -> None:
    """Refuse ``manifests`` unless it has :data:`_SHAPE`; an entry of it, or the list
    itself, that is an iterator is not read here (:func:`as_lists` checks what it
    yields).

    Raises:
        ConfigError: naming ``manifests`` (and the entry) and the shape expected.
    """
    _check_outer(manifests)
    if isinstance(manifests, Sequence):
        for index, spec in enumerate(manifests):
            _check_spec(spec, index)
            if isinstance(spec, Sequence) and not isinstance(spec, str):
                _check_artifacts(spec, index)


def as_lists(manifests: Any) -> list[Any]:
    """``manifests`` as a list with each artifact list in it made a list, so that every
    step of the start-up may read it, checked as :func:`check_manifests` checks it.

    Raises:
        ConfigError: ``manifests`` does not have :data:`_SHAPE`.
    """
    _check_outer(manifests)
    made: list[Any] = []
    for index, spec in enumerate(manifests):
        _check_spec(spec, index)
        if not isinstance(spec, str | os.PathLike):
            spec = spec if isinstance(spec, list) else list(spec)
            _check_artifacts(spec, index)
        made.append(spec)
    return made


def _check_outer(manifests: Any) -> None:
    if isinstance(manifests, str | bytes | os.PathLike):
        raise ConfigError(
            "manifests must be a list of files or artifact lists, not a single path "
            f"({_SHAPE})", variable="manifests", value=repr(manifests))
    if not isinstance(manifests, Iterable):
        raise ConfigError(f"manifests must be {_SHAPE}, not {manifests!r}",
                          variable="manifests", value=repr(manifests))


def _check_spec(spec: Any, index: int) -> None:
    """Refuse ``manifests[index]`` unless it is a ``str`` path or a list (not yet read)."""
    if isinstance(spec, str | os.PathLike):
        if isinstance(os.fspath(spec), str):
            return
    elif isinstance(spec, Iterable) and not isinstance(spec, bytes):
        return
    if isinstance(spec, Artifact):
        why = "an Artifact: a list of artifacts is one entry of manifests"
    elif isinstance(spec, bytes | os.PathLike):
        why = "a bytes path: a manifest's path is a str or os.PathLike of str"
    else:
        why = f"{spec!r}"[:120]
    raise ConfigError(f"manifests[{index}] is {why}; manifests must be {_SHAPE}",
                      variable="manifests", value=repr(spec)[:120])


def _check_artifacts(spec: Sequence[Any], index: int) -> None:
    for position, artifact in enumerate(spec):
        if not isinstance(artifact, Artifact):
            raise ConfigError(
                f"manifests[{index}][{position}] is {artifact!r}"[:160] + ", not an "
                f"Artifact; manifests must be {_SHAPE}", variable="manifests",
                value=repr(artifact)[:120])


def leading_tree(comm: Communicator, timeout: float | None) -> NodeTree | None:
    """``comm``'s node tree where its node leaders act for their nodes (more than one
    node, not one rank each), else None. Collective the first time (see
    :func:`~distcache.comm.node_tree`)."""
    tree = node_tree(comm, timeout=timeout)
    return tree if isinstance(tree, NodeTree) and tree.selected() is tree else None


def set_up_where_downloading(comm: Communicator, pool: ArtifactPool, origin: Origin | None,
                             manifests: Sequence[Any], integrations: Sequence[Integration],
                             offline: bool | None, timeout: float | None,
                             conf: Settings | None = None) -> threading.Thread | None:
    """:func:`prepare_in_background` on a rank that may download in the start-up
    prefetch (a node leader among the :func:`leader_downloaders` first, or every rank
    where no leader acts for its node), unless there is no origin or downloads are
    off, or nothing is listed or wanted; the thread, else None. Collective where
    ``comm``'s node tree is not made yet: it is made first on every rank, whatever this
    rank lists, wants or its origin (the job's ranks may differ there: a rank without
    integrations still takes part in the prefetch, which says how). ``conf``: the
    settings the prefetch runs with (its download counts), else the process's."""
    tree = leading_tree(comm, timeout)
    if origin is None or not (manifests or integrations):
        return None
    if settings().offline if offline is None else offline:
        return None
    if tree is not None and not (tree.is_leader and _may_download(tree, conf)):
        return None
    return prepare_in_background(origin, pool, manifests, integrations)


def leader_threads(ranks: int, nodes: int, conf: Settings | None = None) -> int:
    """Download threads per rank when only node leaders download: each leader may
    take the connections its node's ranks would have had, up to an even share of the
    job's, so a job on a few nodes keeps its concurrency at the origin while one on
    many still spreads its downloads over as many nodes as before. ``conf``: the
    settings, when the caller has read them."""
    conf = settings() if conf is None else conf
    per_rank, per_job = conf.downloads_per_rank, conf.downloads_per_job
    return max(per_rank, min(per_rank * -(-ranks // nodes), -(-per_job // nodes)))


def leader_downloaders(tree: NodeTree, conf: Settings | None = None) -> int:
    """How many node leaders the leaders' prefetch may give downloads to: the job's
    connections over :func:`leader_threads` each. The plan hands them to the first
    ones in node order (:func:`~distcache.collective._plan.node_interleaved` over one
    rank per node), so a leader placed after them never downloads in it. ``conf``: the
    settings the prefetch runs with, else the process's.

    Raises:
        ConfigError: a download count in the environment is malformed.
    """
    from distcache.collective._plan import max_downloaders  # a leader's, loaded once

    conf = settings() if conf is None else conf
    return max_downloaders(leader_threads(tree.size, tree.nodes, conf), conf.downloads_per_job)


def collective_counts(conf: Settings | None, per_rank: int | None = None
                      ) -> dict[str, int | None]:
    """The download counts and bucket size handed to the collective prefetch: those of
    ``conf``, the settings the start-up runs with (None: the collective reads the
    process's), with ``per_rank`` in place of its per-rank count when given (a leader's,
    :func:`leader_threads`)."""
    if conf is None:
        return {"downloads_per_rank": per_rank}
    return {"downloads_per_rank": conf.downloads_per_rank if per_rank is None else per_rank,
            "downloads_per_job": conf.downloads_per_job, "bucket_bytes": conf.bucket_bytes}


def _may_download(tree: NodeTree, conf: Settings | None) -> bool:
    """Whether this leader is among :func:`leader_downloaders` (of ``conf``); True when
    the settings cannot say (the prefetch reports them, on every rank alike)."""
    try:
        return tree.node_index < leader_downloaders(tree, conf)
    except DistcacheError:
        return True


def _manifest_bytes(spec: str | os.PathLike[str]) -> bytes:
    """A manifest file's bytes, as the prefetch will read them: at most
    :data:`~distcache.artifact.MAX_MANIFEST_BYTES` (past it, OSError; the prefetch says
    why), never a whole stream such as ``/dev/zero``."""
    from distcache._bounded import _read_at_most  # a manifest given as a file

    return _read_at_most(Path(spec), MAX_MANIFEST_BYTES)


def inputs_key(manifests: Sequence[str | os.PathLike[str] | Sequence[Artifact]],
               origin: Origin | None, offline: bool | None,
               integrations: Sequence[Integration] = ()) -> str | None:
    """A digest of what decides a rank's prefetch: the manifests (each file's bytes,
    each list's artifacts), what the integrations want (their usage records), whether
    there is an origin, whether downloads are off. None when something cannot be
    read or fails: that rank takes the full collective, which reports why on every
    rank (raising here, on one rank alone, would leave the others waiting)."""
    h = hashlib.sha256()
    try:
        for spec in manifests:
            if isinstance(spec, str | os.PathLike):
                h.update(b"file\0" + hashlib.sha256(_manifest_bytes(spec)).digest())
            else:
                h.update(b"list\0" + repr(list(spec)).encode())
        if integrations:
            wanted = merge_manifests((i.name, i.manifest()) for i in integrations)
            h.update(b"wanted\0" + manifest_text(wanted).encode())
        if offline is None:
            offline = settings().offline
    except Exception:  # any (a path with a NUL, an integration's defect): said by all
        return None
    h.update(f"\0origin={origin is not None}\0offline={bool(offline)}".encode())
    return h.hexdigest()
