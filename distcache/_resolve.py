"""Settings -> pool -> origin -> start-up prefetch, written once for the session, the
CLI and the FlashInfer warm-up.

An explicit argument wins, then the ``DISTCACHE_*`` setting, then what an integration offers
(FlashInfer's own repository, say); see ``distcache.config`` for the table of defaults.
:func:`prefetch_manifests` is the one start-up prefetch: manifests every rank passes alike, plus
what each rank's integrations want (usage records differ per rank, so those are united across ranks
first), merged by :func:`distcache.artifact.merge_manifests` and fetched once per job.

What some pool of the job holds needs no origin: without one (or with ``DISTCACHE_OFFLINE=1``) the
pools' writers first report what they hold, and only an artifact that no pool holds is an error, one
per job, raised alike on every rank, that names what is missing, where, and the command that fetches
it (:func:`missing_error`). What some pools hold and others lack moves between them as usual; the
origin is never asked. What only an integration's usage record lists is a hint: one that no pool
holds then, or that the origin does not have, is left out with one warning, not an error
(FlashInfer's loader fetches it when first used).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distcache._delegate import Aside, led_by_node_leaders
from distcache._log import get_logger
from distcache._prepare import (
    as_lists,
    collective_counts,
    inputs_key,
    leader_threads,
    leading_tree,
    set_up_where_downloading,
)
from distcache.artifact import (
    Artifact,
    manifest_text,
    merge_manifests,
    read_manifest,
    sha256_hex,
)
from distcache.comm import Communicator, agree_on_error, node_tree
from distcache.config import Settings, settings
from distcache.errors import ConfigError, PoolError, PrefetchError
from distcache.origins import Credentials, Origin, open_origin
from distcache.store import ArtifactPool, PoolLayout

if TYPE_CHECKING:
    from distcache.collective import PrefetchReport
    from distcache.integrations import Integration

log = get_logger(__name__)

#: A ``sha256sum``-format file, or a list of artifacts.
ManifestSpec = str | os.PathLike[str] | Sequence[Artifact]

#: Recorded artifacts the origin lacks that a prefetch leaves out one run at a time;
#: past them, every recorded one no pool holds is left out at once (a run each would
#: ask the origin again for all the others, for as many runs as the origin lacks).
_ONE_BY_ONE = 3


def resolve_pool(
    pool: ArtifactPool | str | os.PathLike[str] | None,
    conf: Settings,
    *,
    must_exist: bool = False,
) -> ArtifactPool:
    """The pool to use: ``pool`` when given (an open pool or a directory), else
    ``conf.pool_dir``; capped at ``conf.pool_max_bytes``, waiting ``conf.lock_timeout``.

    Raises:
        PoolError: ``must_exist`` and there is no pool at the directory, or the pool
            cannot be opened or created.
    """
    if isinstance(pool, ArtifactPool):
        return pool
    root = Path(pool) if pool is not None else conf.pool_dir
    if must_exist and not PoolLayout(root).is_pool():
        raise PoolError(
            f"no pool at {root} (no objects/ directory); pass --pool DIR or set "
            "DISTCACHE_POOL, or create one with 'distcache fetch' or 'distcache pool import'",
            path=str(root),
        )
    return ArtifactPool(root, defaults=conf)  # conf's values, not os.environ's


def resolve_origin(
    origin: Origin | str | Sequence[str | Origin] | None,
    conf: Settings,
    integrations: Iterable[Integration] = (),
) -> Origin | None:
    """The origin to use: ``origin`` when given, else ``DISTCACHE_ORIGIN``, else the
    first default an integration offers; ``None`` when there is none.

    ``DISTCACHE_ORIGIN_TOKEN`` goes to the host of the first http(s) entry of
    ``DISTCACHE_ORIGIN``, or of ``origin`` when ``DISTCACHE_ORIGIN`` has none; an
    integration's default gets only a ``DISTCACHE_ORIGIN_TOKENS`` entry for its host.

    Raises:
        ConfigError: a spec names an unknown scheme or a directory that is not one.
    """
    given = [origin] if isinstance(origin, str) or not isinstance(origin, Sequence) else origin
    credentials = Credentials.from_settings(conf, () if origin is None else given)
    spec = origin if origin is not None else list(conf.origins) if conf.origins else next(
        filter(None, (i.default_origin() for i in integrations)), None)  # the first offered
    if spec is None:
        return None
    from distcache.origins._http import DEFAULTS  # loaded with its first use, as HttpOrigin is

    reset = DEFAULTS.set(conf)  # the HTTP origins opened read conf's values, not os.environ's
    try:
        return open_origin(spec, credentials=credentials)
    finally:
        DEFAULTS.reset(reset)


def prefetch_manifests(
    comm: Communicator,
    pool: ArtifactPool,
    origin: Origin | None,
    *,
    manifests: Sequence[ManifestSpec] = (),
    integrations: Sequence[Integration] = (),
    timeout: float | None = None,
    offline: bool | None = None,
    aside: Aside | None = None,
    set_up: bool = True,
    conf: Settings | None = None,
) -> PrefetchReport | None:
    """Collective: every artifact of ``manifests`` (the same on every rank) and of any
    rank's ``integrations`` reaches every pool, each fetched from ``origin`` once
    (``aside``: see :func:`~distcache._delegate.led_by_node_leaders`; ``set_up``: False
    where the caller began the origin's set-up, as :mod:`distcache._prepare` does;
    ``conf``: the settings it runs with, else the process's).

    Returns ``None`` (on every rank alike) when there is nothing to prefetch. A rank
    given neither manifests nor integrations still takes part (the ranks' integrations
    may differ), unless it is the only one. Without an
    origin, or ``offline`` (default ``DISTCACHE_OFFLINE``), nothing is downloaded:
    what some pool holds reaches the others, and an artifact no pool holds is an error.
    An artifact that only an integration's usage record lists is left out instead, with
    one warning, where no pool holds it then or the origin does not have it.

    Raises:
        ConfigError: ``manifests`` is a single path, a manifest cannot be read, or
            some artifact is in no pool and there is no origin or downloads are off
            (on every rank; :func:`missing_error`).
        ManifestError: a malformed manifest or record, or one name with two digests
            (on every rank).
        ManifestMismatchError: ranks passed different manifests (on every rank).
        PrefetchError: a download or transfer failed (on every rank); not for a
            recorded artifact that the origin does not have.
        CollectiveTimeout: not every rank arrived in time.
        WireError: a rank sent a payload of another shape (naming it, on every rank).
    """
    if isinstance(manifests, str | os.PathLike):
        raise ConfigError(
            "manifests must be a list of files or artifact lists, not a single path",
            variable="manifests", value=str(manifests),
        )
    if not manifests and not integrations and comm.size == 1:
        return None  # with more ranks, another's integrations may want something
    manifests = as_lists(manifests)  # read twice (a member's digest, the leader's parse)
    offline = conf.offline if offline is None and conf is not None else offline
    # Every all-gather below goes through node leaders: the ranks of a node mostly send
    # alike (no error, the same pool, the same flags), so what a rank receives follows
    # the nodes, not the ranks. The collective reuses the same tree.
    if set_up:  # a rank that may download sets up its origin's client meanwhile
        set_up_where_downloading(comm, pool, origin, manifests, integrations, offline, timeout,
                                 conf)
    comm = node_tree(comm, timeout=timeout)
    tree = leading_tree(comm, timeout)
    if tree is not None:
        # Where each node's ranks share their leader's pool and pass the same inputs,
        # the leaders prefetch for their nodes (distcache._delegate).
        led = led_by_node_leaders(
            tree, pool, inputs_key(manifests, origin, offline, integrations),
            timeout=timeout, aside=aside,
            lead=lambda leaders: _prefetch(
                leaders, pool, origin, manifests, integrations, timeout, offline, conf,
                downloads_per_rank=leader_threads(tree.size, tree.nodes, conf)))
        if led is not None:
            return led[0]
    return _prefetch(comm, pool, origin, manifests, integrations, timeout, offline, conf)


def _prefetch(comm: Communicator, pool: ArtifactPool, origin: Origin | None,
              manifests: Sequence[ManifestSpec], integrations: Sequence[Integration],
              timeout: float | None, offline: bool | None, conf: Settings | None, *,
              downloads_per_rank: int | None = None) -> PrefetchReport | None:
    """:func:`prefetch_manifests` on every rank of ``comm`` (its node tree, made), the
    collective told :func:`collective_counts` of ``conf`` and ``downloads_per_rank``."""
    comm = node_tree(comm, timeout=timeout)
    listed: list[Artifact] = []
    wanted: list[Artifact] = []
    error: BaseException | None = None
    try:
        listed = merge_manifests(_read(spec, i) for i, spec in enumerate(manifests))
        wanted = merge_manifests((i.name, i.manifest()) for i in integrations)
        if offline is None:
            offline = settings().offline
    except Exception as exc:  # any failure, a defect of an integration's too: said to all
        error = exc
    from distcache._held import NoOrigin, held_anywhere, missing_error, sent_carries

    # A rank that cannot read its manifest or record must not leave the others waiting.
    # The same all-gather carries whether the rank may download, the digest of what
    # its integrations want and that of what it lists: one round where there were four
    # (each rank's checked: a malformed one fails every rank alike).
    wanted_text = manifest_text(wanted).encode()
    carried = sent_carries(agree_on_error(comm, error, timeout=timeout, carry=(
        origin is None, bool(offline), sha256_hex(wanted_text) if wanted else None,
        _list_key(listed))))
    cannot = [(none, off) for none, off, _, _ in carried]
    artifacts = listed
    everyone: list[Artifact] = []
    if any(d is not None for _, _, d, _ in carried):  # said by every rank, not local
        everyone = union_across_ranks(comm, wanted, recorded_ns=_recorded_ns(integrations),
                                      timeout=timeout, digests=[d for _, _, d, _ in carried],
                                      text=wanted_text)
        if everyone:
            try:
                artifacts = merge_manifests([("manifests", listed),
                                             ("integrations of every rank", everyone)])
            except Exception as exc:
                error = exc
            agree_on_error(comm, error, timeout=timeout)
    listed_alike = len({key for *_, key in carried}) == 1
    if not listed_alike and len(set(comm.allgather_object(
            _list_key(artifacts), timeout=timeout))) > 1:
        # The ranks' lists differ (alike on every rank): neither "nothing to do" on some
        # ranks nor a look at the pools by position; the collective's agreement says
        # how they differ, on every rank.
        return collective_prefetch(artifacts, comm=comm, pool=pool,
                                   origin=origin or NoOrigin(bool(offline)),
                                   timeout=timeout, **collective_counts(conf, downloads_per_rank))
    if not artifacts:
        return None
    # What only the integrations want, by name: a usage record is a hint, left out, not
    # an error, where the origin or the pools lack it. Alike on every rank: ``everyone``
    # is, and ``listed`` where every rank's key matches (else none is a hint).
    hints = {a.name for a in everyone} - {a.name for a in listed} if listed_alike else set()
    counts = collective_counts(conf, downloads_per_rank)
    # Whether to look before fetching is decided alike on every rank: a rank without an
    # origin (or offline) makes the whole job fetch nothing.
    if origin is None or any(none or off for none, off in cannot):
        offline = any(off for _, off in cannot)
        held, where = held_anywhere(comm, pool, artifacts, timeout=timeout)
        missing = [a for a, found in zip(artifacts, held, strict=True) if not found]
        strict = [a for a in missing if a.name not in hints]
        if strict:
            files = [s for s in manifests if isinstance(s, str | os.PathLike)]
            error = missing_error(strict, offline=offline, where=where, manifests=files)
            error.agreed = True  # built from what every rank holds alike (unlike fetch's)
            raise error
        if missing:  # only hints: left out, on every rank alike (``held`` is agreed)
            from distcache._held import warn_left_out

            warn_left_out(comm, [a.name for a in missing], "no pool of the job holds them and "
                           + ("DISTCACHE_OFFLINE=1 forbids downloads" if offline
                              else "no origin is set"))
            artifacts = [a for a, found in zip(artifacts, held, strict=True) if found]
            if not artifacts:
                return None
        report = collective_prefetch(artifacts, comm=comm, pool=pool, origin=NoOrigin(offline),
                                     timeout=timeout, **counts)
        return report.replace(left_out=tuple(a.name for a in missing)) if missing else report
    return _fetch_but_hints(artifacts, hints, comm=comm, pool=pool, origin=origin,
                            timeout=timeout, **counts)


def _fetch_but_hints(artifacts: Sequence[Artifact], hints: set[str], *, comm: Communicator,
                     **given: Any) -> PrefetchReport | None:
    """:func:`collective_prefetch` of ``artifacts``; where the origin has no copy of one
    of ``hints``, that one is left out and the rest run again (what the failed run
    fetched is in the pools, so the rerun moves only what is left), for at most
    :data:`_ONE_BY_ONE` hints; then every hint no pool holds is left out and the rest
    run once more. Any other failure is raised. The report names those left out;
    ``None`` when every artifact was. The runs log a hint the origin lacks at INFO.

    Every step follows the :class:`~distcache.errors.PrefetchError` that every rank
    raises alike, built from the same gathered failure records, so every rank leaves
    out the same artifact and runs the same collectives."""
    from distcache.collective._run import HINTS

    left: list[str] = []
    hinted = HINTS.set(frozenset(hints))
    try:
        while True:
            try:
                report = collective_prefetch(artifacts, comm=comm, **given)
                return report.replace(left_out=tuple(left)) if left else report
            except PrefetchError as exc:
                from distcache._held import not_found  # where a run failed

                name = not_found(exc)
                if name is None or name not in hints or name in left:
                    raise
            left.append(name)
            artifacts = [a for a in artifacts if a.name != name]
            if len(left) == _ONE_BY_ONE:  # many lacking: the hints no pool holds go too
                from distcache._held import held_anywhere

                held, _ = held_anywhere(comm, given["pool"], artifacts, timeout=given["timeout"])
                left += [a.name for a, h in zip(artifacts, held, strict=True)
                         if not h and a.name in hints]
                artifacts = [a for a, h in zip(artifacts, held, strict=True)
                             if h or a.name not in hints]
            if not artifacts:
                return None
    finally:
        HINTS.reset(hinted)
        if left:
            from distcache._held import warn_left_out

            warn_left_out(comm, left, "the origin does not have them" if len(left) <= _ONE_BY_ONE
                           else f"the origin does not have the first {_ONE_BY_ONE} of them and "
                           "the rest were not fetched after that")


def collective_prefetch(artifacts: Sequence[Artifact], **given: Any) -> PrefetchReport:
    """:func:`distcache.collective.prefetch`, loaded with its first use: a node member
    whose leader prefetches for it never loads the collective."""
    from distcache.collective import prefetch

    return prefetch(artifacts, **given)


def _list_key(artifacts: Sequence[Artifact]) -> bytes:
    """The names and digests of a merged list (:func:`merge_manifests` orders it), as
    8 bytes of one digest (a few bytes a rank, whatever the list): equal keys, equal
    lists by position (sizes aside, which the collective compares itself)."""
    return bytes.fromhex(sha256_hex(manifest_text(artifacts).encode())[:16])


def _read(spec: ManifestSpec, index: int) -> tuple[str, list[Artifact]]:
    if isinstance(spec, str | os.PathLike):
        return os.fspath(spec), read_manifest(spec)
    return f"manifests[{index}]", list(spec)


def union_across_ranks(
    comm: Communicator, artifacts: Sequence[Artifact], *, recorded_ns: int | None = None,
    timeout: float | None = None, digests: Sequence[str | None] | None = None,
    text: bytes | None = None,
) -> list[Artifact]:
    """Collective: the union of every rank's ``artifacts`` (what its integrations
    recorded), the same list on every rank.

    Ranks that read the same files (a shared record directory) send their list once:
    digests first, then one copy of each distinct list, dated ``recorded_ns`` (when its
    record was last written). When every rank's list is empty that is a single small
    all-gather. A name that two lists give two digests (the nodes' records straddle an
    upgrade) keeps the newest list's, with one warning on rank 0, as one record does.
    ``digests`` are every rank's digest of its list (``sha256`` of its
    :func:`manifest_text`, ``None`` for an empty list) when an all-gather the caller
    made carried them; ``text`` is then this rank's manifest text.

    Raises:
        CollectiveTimeout: not every rank arrived in time.
    """
    if text is None:
        text = manifest_text(artifacts).encode()
    digest = sha256_hex(text) if artifacts else None
    if digests is None:
        digests = comm.allgather_object(digest, timeout=timeout)
    if not any(digests):
        return []
    mine = None
    if digest is not None and digests.index(digest) == comm.rank:
        mine = (zlib.compress(text), recorded_ns or 0)
    sent = comm.allgather_object(mine, timeout=timeout)
    from distcache._held import listed_by, sent_lists  # each checked, inflated capped

    merged: dict[str, Artifact] = {}
    replaced: dict[str, tuple[str, str]] = {}
    for rank, blob in sent_lists(sent):  # oldest first: a later list's digest wins
        for artifact in listed_by(rank, blob):
            before = merged.get(artifact.name)
            if before is not None and before.sha256 != artifact.sha256:
                replaced[artifact.name] = (before.sha256, artifact.sha256)
            if before is None or before.sha256 != artifact.sha256:
                merged[artifact.name] = artifact
    if replaced and comm.rank == 0:
        name, (old, new) = next(iter(sorted(replaced.items())))
        log.warning("the ranks' usage records give %d name(s) two digests (an upgrade on "
                    "some nodes?); kept the newest record's: %s %s..., was %s...",
                    len(replaced), name, new[:12], old[:12])
    return [merged[name] for name in sorted(merged)]


def _recorded_ns(integrations: Sequence[Integration]) -> int | None:
    """When this rank's integrations last recorded what they want (the newest of their
    ``recorded_ns()``, for those that keep a dated record), else ``None``."""
    stamps = [stamp for i in integrations
              if (stamp := getattr(i, "recorded_ns", lambda: None)()) is not None]
    return max(stamps) if stamps else None
