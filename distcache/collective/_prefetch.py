"""The collective prefetch: make every pool hold every listed artifact, fetching each
missing one from the origin exactly once per job (phases: see :mod:`distcache.collective`).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable

from distcache.artifact import Artifact, manifest_text
from distcache.collective._heartbeat import concurrent
from distcache.collective._plan import Plan, download_threads, make_plan, max_downloaders
from distcache.collective._progress import Progress, bytes_for_rank0
from distcache.collective._report import PrefetchReport
from distcache.collective._run import Moving, Run, discover
from distcache.collective._sharing import agree_pools
from distcache.collective._totals import finish
from distcache.comm import Communicator, node_tree
from distcache.config import settings
from distcache.errors import ManifestError, ManifestMismatchError
from distcache.origins import Origin
from distcache.store import Pool


def _agreed_list(artifacts: Iterable[Artifact]) -> list[Artifact]:
    """Sorted by (name, sha), one entry per pair, a known size kept."""
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
    unique: dict[tuple[str, str], Artifact] = {}
    for a in items:
        key = (a.name, a.sha256)
        if key not in unique or unique[key].size is None:
            unique[key] = a
    return [unique[k] for k in sorted(unique)]


def _mismatch(digests: list[tuple[str, int]]) -> ManifestMismatchError:
    groups: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    for rank, (digest, count) in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
        counts[digest] = count
    parts = "; ".join(
        f"ranks {ranks} have {digest[:12]} ({counts[digest]} artifacts)"
        for digest, ranks in groups.items()
    )
    return ManifestMismatchError(
        f"ranks called prefetch with different artifact lists: {parts}; "
        "every rank must pass the same list",
        groups=groups, counts=counts,
    )


def prefetch(
    artifacts: Iterable[Artifact],
    *,
    comm: Communicator,
    pool: Pool,
    origin: Origin,
    timeout: float | None = None,
    bucket_bytes: int | None = None,
    downloads_per_rank: int | None = None,
    downloads_per_job: int | None = None,
) -> PrefetchReport:
    """Collective: make every rank's pool hold every artifact, fetching each missing
    one from ``origin`` exactly once per job.

    Call on every rank of ``comm`` with the same ``artifacts`` (order and duplicates
    do not matter). ``timeout`` bounds every wait (default ``DISTCACHE_TIMEOUT``);
    ``bucket_bytes`` is the size of one broadcast (``DISTCACHE_BUCKET_BYTES``);
    ``downloads_per_rank`` the download threads per rank
    (``DISTCACHE_DOWNLOADS_PER_RANK``) and ``downloads_per_job`` the most concurrent
    origin downloads over all ranks (``DISTCACHE_DOWNLOADS_PER_JOB``): as few ranks
    download as carry it at ``downloads_per_rank`` each, spread over the nodes.

    Raises:
        ManifestMismatchError: ranks passed different lists (on every rank).
        ManifestError: one name is listed with two digests (on every rank).
        PrefetchError: a download, read, verification or publication failed on some
            rank, or a peer did not arrive in time (the same error on every rank).
        ConfigError: a bad setting.
    """
    conf = settings(
        timeout=timeout, bucket_bytes=bucket_bytes, downloads_per_rank=downloads_per_rank,
        downloads_per_job=downloads_per_job,
    )
    run = Run("prefetch", comm, pool, conf.timeout)

    def body() -> PrefetchReport:
        with run.phase("agree"):
            # Every all-gather of the collective goes through node leaders from here.
            run.comm = comm = node_tree(run.comm, timeout=run.timeout)
            listing = _agreed_list(artifacts)
            digest = hashlib.sha256(manifest_text(listing).encode()).hexdigest()
            infos = comm.allgather_object(
                (digest, len(listing), pool.pool_id, comm.node_id), timeout=run.timeout
            )
            if len({i[0] for i in infos}) > 1:
                raise _mismatch([(i[0], i[1]) for i in infos])
            artifact_of: dict[str, Artifact] = {}
            for a in listing:
                artifact_of.setdefault(a.sha256, a)
            names = [a.name for a in listing]
            dup = next((n for n, m in itertools.pairwise(names) if n == m), None)
            if dup is not None:
                raise ManifestError(f"{dup} is listed with two digests", line=0, text=dup)
            node_ids = [i[3] for i in infos]
            # Equal ids are a claim; the ranks that see one directory share a writer.
            pool_ids = agree_pools(run, [i[2] for i in infos], node_ids)
            objects = sorted(artifact_of)
        with run.phase("discover"):
            have = discover(run, objects, pool_ids)
        with run.phase("plan"):
            # The job's connections on as few ranks as carry them at the per-rank
            # count: the same concurrency at the origin, and the ranks that set up
            # an HTTP client and download threads are a handful, not one per node.
            plan = make_plan(
                objects, [artifact_of[s].size for s in objects], pool_ids, node_ids, have,
                max_downloaders=max_downloaders(conf.downloads_per_rank,
                                                conf.downloads_per_job),
            )
        if comm.rank == 0:
            run.progress = Progress(
                bytes_for_rank0(plan, [artifact_of[s].size for s in objects], pool_ids),
                enabled=True)
        name_of = {sha: a.name for sha, a in artifact_of.items()}
        with run.durable():
            moving: Moving | None = None
            with run.phase("fetch"):
                mine = plan.downloads.get(comm.rank, ())
                todo = [artifact_of[plan.objects[i]] for i in mine]
                threads = download_threads(plan, comm.rank, conf.downloads_per_rank,
                                           conf.downloads_per_job)
                if plan.downloads:  # progress extends the phase; silence ends it
                    moving = _fetch(run, plan, pool_ids, todo, origin, threads,
                                    conf.bucket_bytes)
            with run.phase("move"):  # with a move beside the fetch: what is left of it
                if moving is not None:
                    run.finish_move(moving, plan, name_of)
                elif plan.sends:
                    run.check(run.move(plan, pool_ids, name_of, conf.bucket_bytes))
        with run.phase("publish"):
            failure = None
            if plan.writers[pool_ids[comm.rank]] == comm.rank:
                try:
                    pool.remember(listing)
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
