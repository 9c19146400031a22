"""The collective prefetch: make every pool hold every listed artifact, fetching each
missing one from the origin exactly once per job (phases: see :mod:`distcache.collective`).

Every input of the plan is agreed on in the agree phase's one all-gather, so that every
rank computes the same plan: the list, sizes included (its digest), and the download
counts (the smallest of each that any rank passed).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from distcache._log import get_logger
from distcache.artifact import Artifact, manifest_text
from distcache.collective._arguments import NoneGiven, checked
from distcache.collective._heartbeat import concurrent
from distcache.collective._plan import Plan, download_threads, make_plan, max_downloaders
from distcache.collective._progress import Progress, bytes_for_rank0
from distcache.collective._report import PrefetchReport
from distcache.collective._run import Moving, Run, discover, own_settings
from distcache.collective._sharing import agree_pools
from distcache.collective._totals import finish
from distcache.comm import Communicator, node_tree
from distcache.errors import ManifestError, ManifestMismatchError, WireError
from distcache.origins import Origin
from distcache.store import Pool

log = get_logger(__name__)


def _agreed_list(artifacts: Iterable[Artifact]) -> list[Artifact]:
    """Sorted by (name, sha), one entry per pair, a known size kept. A pair listed with
    two known sizes keeps one entry per size (in size order): the list contradicts
    itself, and :func:`_artifact_of` refuses it on every rank alike once the ranks
    have agreed on it (a rank that settled on one of them alone would plan apart)."""
    items = list(artifacts)
    # A list already strictly in (name, sha) order (what merge_manifests returns) has
    # no pair twice: one pass shows it, and it is its own answer.
    previous: tuple[str, str] | None = None
    for a in items:
        key = (a.name, a.sha256)
        if previous is not None and key <= previous:
            break
        previous = key
    else:
        return items
    unique: dict[tuple[str, str], dict[int | None, Artifact]] = {}
    for a in items:
        sizes = unique.setdefault((a.name, a.sha256), {})
        if a.size is not None:
            sizes.pop(None, None)
            sizes.setdefault(a.size, a)
        elif not sizes:
            sizes[None] = a
    out: list[Artifact] = []
    for key in sorted(unique):
        sized = unique[key]
        out.extend(sized[s] for s in sorted(sized, key=lambda s: -1 if s is None else s))
    return out


class _Said(NamedTuple):
    """What each rank says in the agree phase's all-gather."""

    digest: str  #: the list's, sizes included (:func:`_digests`)
    listed: int  #: artifacts in the list
    pool_id: str
    node_id: str
    names: str  #: the digest of its names and digests alone (``manifest_text``)
    counts: tuple[int, int]  #: its downloads_per_rank and downloads_per_job


def _said_by(rank: int, one: Any) -> _Said:
    """What rank ``rank`` said, checked to be a :class:`_Said` as every rank sends it:
    the counts two whole numbers of at least 1 (the plan divides by them).

    Raises:
        WireError: it is not (naming the rank): every rank received the same, so every
            rank raises it alike.
    """
    if (type(one) is tuple and len(one) == len(_Said._fields)
            and all(type(v) is str for v in (one[0], *one[2:5]))
            and type(one[1]) is int and one[1] >= 0
            and type(one[5]) is tuple and len(one[5]) == 2
            and all(type(c) is int and c >= 1 for c in one[5])):
        return _Said(*one)
    raise WireError(f"prefetch: rank {rank} sent a malformed agreement (list digest, "
                    f"size, pool, node, names digest, download counts) {one!r:.300}",
                    op="agree", peer=rank,
                    agreed=True)  # built from the all-gather: the same on every rank


def _digests(listing: Sequence[Artifact]) -> tuple[str, str]:
    """``(digest of the list with its sizes, digest of its names and digests)``; a
    size left unknown (``None``) is a word of its own, not a number."""
    names = hashlib.sha256(manifest_text(listing).encode()).hexdigest()
    sizes = " ".join("-" if a.size is None else str(a.size) for a in listing)
    return hashlib.sha256(f"{names}\n{sizes}".encode()).hexdigest(), names


def _mismatch(said: Sequence[_Said]) -> ManifestMismatchError:
    groups: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    for rank, one in enumerate(said):
        groups.setdefault(one.digest, []).append(rank)
        counts[one.digest] = one.listed
    parts = "; ".join(
        f"ranks {ranks} have {digest[:12]} ({counts[digest]} artifacts)"
        for digest, ranks in groups.items()
    )
    if len({one.names for one in said}) == 1:
        what, rule = ("the same names and digests but different sizes",
                      "every rank must pass the same list, sizes included (a size one "
                      "rank leaves unknown differs from one another rank gives)")
    else:
        what, rule = "different artifact lists", "every rank must pass the same list"
    return ManifestMismatchError(f"ranks called prefetch with {what}: {parts}; {rule}",
                                 groups=groups, counts=counts,
                                 agreed=True)  # built from the all-gather: the same on every rank


def _artifact_of(listing: Sequence[Artifact]) -> dict[str, Artifact]:
    """``sha -> artifact`` of the agreed list: its first name, with the size that any
    entry of that digest gives (on every rank alike, as the list is agreed).

    Raises:
        ManifestError: a name listed with two digests, or a digest with two sizes.
    """
    def refused(message: str, text: str) -> ManifestError:
        return ManifestError(message, line=0, text=text, agreed=True)

    dup = next((a.name for a, b in itertools.pairwise(listing)
                if a.name == b.name and a.sha256 != b.sha256), None)
    if dup is not None:
        raise refused(f"{dup} is listed with two digests", dup)
    artifact_of: dict[str, Artifact] = {}
    for a in listing:
        first = artifact_of.setdefault(a.sha256, a)
        if a.size is None or first.size == a.size:
            continue
        if first.size is not None:
            raise refused(f"{a.sha256} is listed with two sizes: {first.size} "
                          f"({first.name}) and {a.size} ({a.name})", a.name)
        artifact_of[a.sha256] = Artifact(first.name, a.sha256, a.size)
    return artifact_of


def _agreed_counts(said: Sequence[_Said], rank: int) -> tuple[int, int]:
    """The download counts every rank plans with: the smallest of each that any rank
    passed (an argument or its environment), so that no rank's limit is exceeded;
    rank 0 warns, naming the setting and which ranks passed what, when they differ."""
    agreed = (min(s.counts[0] for s in said), min(s.counts[1] for s in said))
    if rank != 0:
        return agreed
    settings_ = (("downloads_per_rank", "DISTCACHE_DOWNLOADS_PER_RANK"),
                 ("downloads_per_job", "DISTCACHE_DOWNLOADS_PER_JOB"))
    for i, (argument, variable) in enumerate(settings_):
        by_value: dict[int, list[int]] = {}
        for r, one in enumerate(said):
            by_value.setdefault(one.counts[i], []).append(r)
        if len(by_value) > 1:
            parts = "; ".join(f"{value} on ranks {_few(ranks)}"
                              for value, ranks in sorted(by_value.items()))
            log.warning("prefetch: the ranks passed different %s (%s): %s; every rank "
                        "plans with the smallest, %d", argument, variable, parts, agreed[i])
    return agreed


def _few(ranks: list[int]) -> str:
    """``ranks`` for a message: the first eight, and how many more."""
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"{ranks[:8]}{more}"


def prefetch(
    artifacts: Iterable[Artifact],
    *,
    comm: Communicator,
    pool: Pool,
    origin: Origin | None,
    timeout: float | None = None,
    bucket_bytes: int | None = None,
    downloads_per_rank: int | None = None,
    downloads_per_job: int | None = None,
) -> PrefetchReport:
    """Collective: make every rank's pool hold every artifact, fetching each missing
    one from ``origin`` exactly once per job (``None``: none is fetched; what the pools
    hold moves between them, and an artifact no pool holds fails the prefetch).

    Call on every rank of ``comm`` with the same ``artifacts``, sizes included (order
    and repeats do not matter; a repeat without a size takes the size another entry
    gives, and a size one rank leaves unknown differs from one another rank gives: the
    plan balances the downloads by size). ``timeout`` bounds every wait (default
    ``DISTCACHE_TIMEOUT``); ``bucket_bytes`` is the size of one broadcast
    (``DISTCACHE_BUCKET_BYTES``); ``downloads_per_rank`` the download threads per rank
    (``DISTCACHE_DOWNLOADS_PER_RANK``) and ``downloads_per_job`` the most concurrent
    origin downloads over all ranks (``DISTCACHE_DOWNLOADS_PER_JOB``): as few ranks
    download as carry it at ``downloads_per_rank`` each, spread over the nodes. Ranks
    that pass different download counts all plan with the smallest of each (the
    strictest limit holds; rank 0 logs a warning naming them).

    Raises:
        ManifestMismatchError: ranks passed different lists, or the same names and
            digests with different sizes (on every rank).
        ManifestError: one name is listed with two digests, or one digest with two
            sizes (on every rank).
        PrefetchError: a download, read, verification or publication failed on some
            rank, or a peer did not arrive in time (the same error on every rank).
        ConfigError: a bad setting, or an argument of the wrong kind (a path for
            ``artifacts``, a path for ``pool``).
    """
    artifacts = checked("prefetch", comm, pool, origin=origin, artifacts=artifacts)
    origin = NoneGiven() if origin is None else origin
    conf = own_settings(
        comm, timeout=timeout, bucket_bytes=bucket_bytes, downloads_per_rank=downloads_per_rank,
        downloads_per_job=downloads_per_job,
    )
    run = Run("prefetch", comm, pool, conf.timeout)

    def body() -> PrefetchReport:
        with run.phase("agree"):
            # Every all-gather of the collective goes through node leaders from here.
            run.comm = comm = node_tree(run.comm, timeout=run.timeout)
            listing = _agreed_list(artifacts)
            digest, names = _digests(listing)
            # Whatever the plan reads is said here, so every rank plans alike.
            said = [_said_by(rank, one) for rank, one in enumerate(comm.allgather_object(
                tuple(_Said(digest, len(listing), pool.pool_id, comm.node_id, names,
                            (conf.downloads_per_rank, conf.downloads_per_job))),
                timeout=run.timeout))]
            if len({one.digest for one in said}) > 1:
                raise _mismatch(said)
            artifact_of = _artifact_of(listing)
            per_rank, per_job = _agreed_counts(said, comm.rank)
            node_ids = [one.node_id for one in said]
            # Equal ids are a claim; the ranks that see one directory share a writer.
            pool_ids = agree_pools(run, [one.pool_id for one in said], node_ids)
            objects = sorted(artifact_of)
        with run.phase("discover"):
            have = discover(run, objects, pool_ids)
        with run.phase("plan"):
            # The job's connections on as few ranks as carry them at the per-rank
            # count: the same concurrency at the origin, and the ranks that set up
            # an HTTP client and download threads are a handful, not one per node.
            plan = make_plan(
                objects, [artifact_of[s].size for s in objects], pool_ids, node_ids, have,
                max_downloaders=max_downloaders(per_rank, per_job),
            )
        if comm.rank == 0:
            run.progress = Progress(
                bytes_for_rank0(plan, [artifact_of[s].size for s in objects], pool_ids),
                enabled=True)
        name_of = {sha: a.name for sha, a in artifact_of.items()}
        with run.durable():
            # The set is this run's whatever brought it: what discovery found in this
            # pool, and (after the move) what other ranks downloaded or moved in; a
            # capped pool's collection when the batch ends keeps all of it.
            mine_held = have[pool_ids[comm.rank]]
            pool.hold([s for s, held in zip(objects, mine_held, strict=True) if held])
            moving: Moving | None = None
            with run.phase("fetch"):
                mine = plan.downloads.get(comm.rank, ())
                todo = [artifact_of[plan.objects[i]] for i in mine]
                threads = download_threads(plan, comm.rank, per_rank, per_job)
                if plan.downloads:  # progress extends the phase; silence ends it
                    moving = _fetch(run, plan, pool_ids, todo, origin, threads,
                                    conf.bucket_bytes)
            with run.phase("move"):  # with a move beside the fetch: what is left of it
                if moving is not None:
                    run.finish_move(moving, plan, name_of)
                elif plan.sends:
                    run.check(run.move(plan, pool_ids, name_of, conf.bucket_bytes))
            pool.hold([s for s, held in zip(objects, mine_held, strict=True) if not held])
        with run.phase("publish"):
            failure = None
            if plan.writers[pool_ids[comm.rank]] == comm.rank:
                try:  # a pool read, not written (its objects all held), warns once
                    pool.label(listing)
                except Exception as exc:
                    failure = run.failure("publish", None, exc)
        return finish(run, plan, len(listing), failure)

    try:
        return run.guarded(body)
    finally:
        run.progress.close()  # rank 0's bar, on failure as on success




def _fetch(run: Run, plan: Plan, pool_ids: list[str], todo: list[Artifact], origin: Origin,
           threads: int, bucket_bytes: int) -> Moving | None:
    """The fetch phase; where the plan also moves objects and the transport takes two
    threads, the move starts first, beside the downloads: a source sends each object
    as it lands instead of after the last, so a cold start waits for the last
    downloads' bucket only, not for the whole move after the whole fetch (objects that
    another rank downloads into this rank's pool are sent once the phase is over).
    Returns that move (the caller finishes it), else None."""
    from distcache.collective._download import Pending

    if not (plan.sends and concurrent(run.comm)):
        run.fetch(todo, origin, threads)
        return None
    # What this rank's pool is getting: its own downloads settle one by one, those of
    # the ranks that share its pool when the fetch phase ends (every rank's are over).
    pool_id = pool_ids[run.comm.rank]
    pending = Pending(plan.objects[i] for r, mine in plan.downloads.items()
                      if pool_ids[r] == pool_id for i in mine)
    moving = run.start_move(plan, pool_ids, bucket_bytes, arrivals=pending)
    try:
        run.fetch(todo, origin, threads, pending)
    except BaseException:
        # Every object is settled now (the failed ones are sent as unreadable), so the
        # move ends on every rank; its own waits are bounded by the timeout.
        moving[0].join(run.timeout)
        raise
    return moving
