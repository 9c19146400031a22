"""The collective prefetch over real processes (MPI or torch gloo, per
``DISTCACHE_TEST_COMM``), against a real loopback HTTP origin run by rank 0."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, parse_checksums
from distcache.collective import SyncState, prefetch, sync
from distcache.comm._base import Communicator
from distcache.errors import PrefetchError
from distcache.origins import HttpOrigin
from distcache.store._pool import ArtifactPool
from tests.support.helpers import serve_slowly

K = 12

LAYOUTS: dict[str, Callable[[Communicator], str]] = {
    # node-local pools by node id (one pool when every rank runs on this host)
    "node": lambda c: f"node-{c.node_id}",
    # two simulated nodes of two ranks each
    "pairs": lambda c: f"pair{c.rank // 2}",
    "rank": lambda c: f"rank{c.rank}",
}


def stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/_stats", timeout=10) as answer:
        return dict(json.load(answer))


@pytest.fixture
def origin_url(comm: Communicator, shared_tmp: Path) -> Iterator[tuple[str, list[Artifact]]]:
    """Rank 0 writes K artifacts and serves them; every rank gets the URL and the list."""
    mirror = shared_tmp / "mirror"
    server = None
    if comm.rank == 0:
        from distcache.testing import LoopbackOrigin, make_artifacts

        make_artifacts(mirror, K, min_size=1000, max_size=40_000)
        server = LoopbackOrigin(mirror)
    sent = server.url.encode() if server is not None else None
    url = comm.broadcast_bytes(sent, 0).decode()
    artifacts = parse_checksums((mirror / "checksums.txt").read_text())
    try:
        yield url, artifacts
    finally:
        comm.barrier()
        if server is not None:
            server.stop()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_artifact_is_fetched_once_per_job_and_every_pool_is_identical(
    comm: Communicator, shared_tmp: Path, origin_url: tuple[str, list[Artifact]], layout: str
) -> None:
    url, artifacts = origin_url
    pool = ArtifactPool(shared_tmp / "pools" / LAYOUTS[layout](comm))
    origin = HttpOrigin(url, retries=0)

    report = prefetch(artifacts, comm=comm, pool=pool, origin=origin, bucket_bytes=64_000)
    assert stats(url)["total_requests"] == K
    assert report.downloads == K and report.pool_hits == 0
    contents = comm.allgather_object((sorted(pool.objects()), pool.names()))
    assert all(c == contents[0] for c in contents)
    assert contents[0][0] == sorted(a.sha256 for a in artifacts)
    reports = comm.allgather_object(report.as_dict())  # plain data crosses ranks
    assert all(r == reports[0] for r in reports)
    if report.pools > 1:
        assert report.broadcasts > 0 and len(report.downloaders) > 1

    again = prefetch(artifacts, comm=comm, pool=pool, origin=origin)
    assert stats(url)["total_requests"] == K
    assert again.downloads == 0 and again.broadcast_bytes == 0 and again.pool_hits == K


@pytest.mark.mpi(min_size=2)
def test_origin_failure_is_the_same_prefetch_error_on_every_rank(
    comm: Communicator, shared_tmp: Path, origin_url: tuple[str, list[Artifact]]
) -> None:
    url, artifacts = origin_url
    pool = ArtifactPool(shared_tmp / "pools" / f"rank{comm.rank}")
    bad = Artifact("cubins/absent.cubin", "0" * 64)  # the origin has no such file
    with pytest.raises(PrefetchError) as caught:
        prefetch([*artifacts, bad], comm=comm, pool=pool, origin=HttpOrigin(url, retries=0))
    err = caught.value
    assert err.artifact == bad.name and bad.name in str(err) and err.host in str(err)
    seen = comm.allgather_object((err.artifact, err.rank, err.host, str(err)))
    assert all(s == seen[0] for s in seen)


@pytest.mark.mpi(min_size=2)
def test_sync_spreads_what_one_rank_fetched_lazily(comm: Communicator, shared_tmp: Path) -> None:
    pool = ArtifactPool(shared_tmp / "pools" / f"rank{comm.rank}")
    data = b"warm-up kernel " * 1000
    from distcache.artifact import sha256_hex

    art = Artifact("cubins/warm.cubin", sha256_hex(data))
    if comm.rank == comm.size - 1:
        pool.put(data, art.sha256)
        pool.remember([art])
    report = sync(comm=comm, pool=pool, state=SyncState())
    assert pool.get(art.sha256) == data and pool.names() == {art.name: art.sha256}
    assert report.downloads == 0 and report.objects_published == comm.size - 1


def _fill(pool: ArtifactPool, mirror: Path, artifacts: list[Artifact]) -> None:
    for a in artifacts:
        pool.put((mirror / a.name).read_bytes(), a.sha256)


REPAIR_LAYOUTS: dict[str, Callable[[Communicator], str]] = {
    "rank": lambda c: f"rank{c.rank}",
    # ranks 0 and 1 share a pool, so the writers are a sub-communicator of the world
    "shared-pair": lambda c: "pair" if c.rank < 2 else f"rank{c.rank}",
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", sorted(REPAIR_LAYOUTS))
def test_a_replaced_pool_is_filled_from_one_warm_pool_and_no_other_receives(
    comm: Communicator, shared_tmp: Path, origin_url: tuple[str, list[Artifact]], layout: str
) -> None:
    url, artifacts = origin_url
    if layout == "shared-pair" and comm.size < 3:
        pytest.skip("shared-pair needs a rank outside the pair: run with 3 or more ranks")
    total = sum(len((shared_tmp / "mirror" / a.name).read_bytes()) for a in artifacts)
    last = comm.size - 1
    # Twice, with a fresh empty pool on the last rank: the second call reuses the
    # audience's communicator.
    for attempt in range(2):
        pool = ArtifactPool(shared_tmp / f"pools{attempt}" / REPAIR_LAYOUTS[layout](comm))
        if comm.rank != last:
            _fill(pool, shared_tmp / "mirror", artifacts)
        report = prefetch(artifacts, comm=comm, pool=pool, origin=HttpOrigin(url, retries=0))
        assert stats(url)["total_requests"] == 0
        assert sorted(pool.objects()) == sorted(a.sha256 for a in artifacts)
        assert report.received_bytes == total and report.discarded_bytes == 0
        assert report.objects_published == K and report.pool_hits == 0


@pytest.mark.mpi(min_size=2)
def test_each_pool_receives_only_the_objects_it_lacks(
    comm: Communicator, shared_tmp: Path, origin_url: tuple[str, list[Artifact]]
) -> None:
    url, artifacts = origin_url
    mirror = shared_tmp / "mirror"
    # Rank r lacks the objects k with k % size == r: one audience per rank.
    mine = [a for k, a in enumerate(artifacts) if k % comm.size != comm.rank]
    lacked = sum(len((mirror / a.name).read_bytes()) for a in artifacts)
    for attempt in range(2):
        pool = ArtifactPool(shared_tmp / f"pools{attempt}" / f"rank{comm.rank}")
        _fill(pool, mirror, mine)
        report = sync(comm=comm, pool=pool)
        assert sorted(pool.objects()) == sorted(a.sha256 for a in artifacts)
        assert report.received_bytes == lacked and report.discarded_bytes == 0
        assert report.objects_published == K
    assert stats(url)["total_requests"] == 0


# -- deadlines: progress extends the fetch, silence ends it ---------------------------

STEADY = 12  # artifacts, one download at a time for the whole job
SLOW = 0.25  # seconds the origin takes for each
SHORT = 2.0  # DISTCACHE_TIMEOUT: well under the STEADY * SLOW the fetch takes


@pytest.fixture
def slow_origin(comm: Communicator, shared_tmp: Path) -> Iterator[tuple[Any, str, list[Artifact]]]:
    """Rank 0 serves STEADY artifacts at SLOW seconds each; every rank gets the URL."""
    mirror = shared_tmp / "slow"
    server, url = serve_slowly(comm, mirror, STEADY, SLOW, seed=11)
    try:
        yield server, url, parse_checksums((mirror / "checksums.txt").read_text())
    finally:
        comm.barrier()
        if server is not None:
            server.stop()


@pytest.mark.mpi(min_size=2)
def test_a_slow_steady_origin_finishes_on_every_rank_past_the_timeout(
    comm: Communicator, shared_tmp: Path, slow_origin: tuple[Any, str, list[Artifact]]
) -> None:
    _, url, artifacts = slow_origin
    pool = ArtifactPool(shared_tmp / "pools" / f"rank{comm.rank}")
    start = time.monotonic()
    report = prefetch(artifacts, comm=comm, pool=pool, origin=HttpOrigin(url, retries=0),
                      timeout=SHORT, downloads_per_rank=1, downloads_per_job=1)
    elapsed = time.monotonic() - start
    assert report.downloads == STEADY and stats(url)["total_requests"] == STEADY
    assert sorted(pool.objects()) == sorted(a.sha256 for a in artifacts)
    # Every rank waited for the one downloader for longer than the timeout.
    assert min(comm.allgather_object(elapsed)) > SHORT


@pytest.mark.mpi(min_size=2)
def test_a_download_that_stalls_fails_every_rank_alike_within_the_timeout(
    comm: Communicator, shared_tmp: Path, slow_origin: tuple[Any, str, list[Artifact]]
) -> None:
    server, url, artifacts = slow_origin
    stuck = artifacts[len(artifacts) // 2]
    if server is not None:
        server.inject("hang", path=stuck.name, seconds=60)
    comm.barrier()
    pool = ArtifactPool(shared_tmp / "pools" / f"rank{comm.rank}")
    start = time.monotonic()
    with pytest.raises(PrefetchError) as caught:
        prefetch(artifacts, comm=comm, pool=pool, origin=HttpOrigin(url, retries=0),
                 timeout=SHORT)
    elapsed = time.monotonic() - start
    err = caught.value
    seen = comm.allgather_object((str(err), err.artifact, err.rank, elapsed))
    assert len({s[:3] for s in seen}) == 1, seen
    assert err.artifact == stuck.name and "did not finish within" in str(err)
    # The other artifacts arrive at once; the stalled one is given up after the timeout
    # without progress, plus a heartbeat and a loaded machine's slack.
    assert max(s[3] for s in seen) < SHORT + 6.0, seen
    if server is not None:
        server.stop()  # wakes the hung handler
