"""Every input of the prefetch's plan is agreed on before the plan is made.

The plan reads each artifact's size (to balance the downloads and to pick the audiences)
and the download counts (how many ranks download). Ranks that agree on the names and
digests but not on those used to plan apart: the origin was asked twice for one object
and never for another, then a misleading bucket error or a wait for the timeout. Now a
size is part of the list the ranks agree on, and the download counts are settled, in
the one all-gather the agree phase already makes.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.collective import PrefetchReport, prefetch
from distcache.collective._prefetch import _agreed_list
from distcache.comm import Communicator, ThreadGroup
from distcache.errors import ManifestError, ManifestMismatchError
from tests.support.threads import run_ranks
from tests.unit.test_prefetch import ConcurrencyOrigin, FakeOrigin, make_blobs, make_pools, ok

pytestmark = pytest.mark.timeout(120)

# A peer's absence is a failure after this long (the defect's runs waited it out).
TIMEOUT = 3.0


def on_two_ranks(lists: list[list[Artifact]], origin: FakeOrigin, **per_rank: list[Any]
                 ) -> tuple[list[Any], dict[str, Any]]:
    """``prefetch`` on two thread-ranks on two nodes, each with a pool of its own, rank
    r passing ``lists[r]`` and ``{key: values[r]}`` of ``per_rank``: each rank's report
    or error, and the pools' stores."""
    pools, stores = make_pools(2, lambda r: f"rank{r}")
    group = ThreadGroup(2, ["n0", "n1"], timeout=TIMEOUT)

    def body(comm: Communicator) -> PrefetchReport:
        given = {key: values[comm.rank] for key, values in per_rank.items()}
        return prefetch(lists[comm.rank], comm=comm, pool=pools[comm.rank], origin=origin,
                        timeout=TIMEOUT, **given)

    return run_ranks(group, body, limit=60), stores


def alike(results: list[Any], kind: type[BaseException]) -> BaseException:
    """The one error every rank raised, checked to be a ``kind`` and the same."""
    for result in results:
        assert isinstance(result, kind), result
    assert len({str(r) for r in results}) == 1
    first: BaseException = results[0]
    return first


def unsized(artifacts: list[Artifact]) -> list[Artifact]:
    return [Artifact(a.name, a.sha256) for a in artifacts]


def resized(artifacts: list[Artifact], index: int, size: int | None) -> list[Artifact]:
    return [Artifact(a.name, a.sha256, size) if i == index else a
            for i, a in enumerate(artifacts)]


@pytest.mark.parametrize("sizes", ["unknown on one rank", "two known sizes"])
def test_ranks_that_differ_in_a_size_fail_alike_before_any_request(sizes: str) -> None:
    # The reviewer's case: the same names and digests, one size differing. Each rank
    # balanced its plan by its own sizes and the two plans gave one object to both
    # ranks and the other to neither.
    arts, blobs = make_blobs(2, low=1000, high=4000)
    if sizes == "unknown on one rank":
        lists = [resized(unsized(arts), 1, arts[1].size), unsized(arts)]
    else:  # rank 1 takes the smaller object for the larger
        smaller = min(range(2), key=lambda i: arts[i].size or 0)
        lists = [arts, resized(arts, smaller, 10**9)]
    origin = FakeOrigin(blobs)
    results, stores = on_two_ranks(lists, origin)
    error = alike(results, ManifestMismatchError)
    assert isinstance(error, ManifestMismatchError)
    assert sorted(error.groups.values()) == [[0], [1]]
    assert set(error.counts.values()) == {2}
    assert "different sizes" in str(error)
    assert origin.total == 0
    assert all(not s.objects for s in stores.values())


def test_a_pair_listed_with_two_sizes_is_refused_alike_in_any_order() -> None:
    # A repeat kept whichever size came first: two ranks that listed the same entries
    # in another order agreed on the list and planned with different sizes.
    arts, blobs = make_blobs(3)
    small, large = (Artifact(arts[0].name, arts[0].sha256, n) for n in (10, 10**6))
    assert _agreed_list([small, large]) == _agreed_list([large, small])
    lists = [[small, *arts[1:], large], [large, *arts[1:], small]]
    origin = FakeOrigin(blobs)
    results, _ = on_two_ranks(lists, origin)
    error = alike(results, ManifestError)
    assert not isinstance(error, ManifestMismatchError)
    assert "two sizes" in str(error) and arts[0].sha256 in str(error)
    assert origin.total == 0


@pytest.mark.parametrize(("per_rank", "per_job", "downloaders"), [
    ([1, 1], [1, 16], (0,)),  # e.g. DISTCACHE_DOWNLOADS_PER_JOB=1 on rank 0's node only
    ([4, 1], [2, 2], (0, 1)),
])
def test_ranks_that_pass_different_download_counts_plan_with_the_smallest(
        per_rank: list[int], per_job: list[int], downloaders: tuple[int, ...],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="distcache.collective._prefetch")
    arts, blobs = make_blobs(8)
    origin = ConcurrencyOrigin(blobs)
    results, stores = on_two_ranks([arts, arts], origin, downloads_per_rank=per_rank,
                                   downloads_per_job=per_job)
    reports = ok(results)
    # One origin request per object, by the ranks the smallest counts make downloaders.
    assert dict(origin.requests) == {a.name: 1 for a in arts}
    assert origin.most <= min(per_job)
    assert [r.downloaders for r in reports] == [downloaders, downloaders]
    assert all(s.objects == blobs for s in stores.values())
    # Rank 0 says which setting differed and what each rank passed, once.
    differ = "downloads_per_job" if len(set(per_job)) > 1 else "downloads_per_rank"
    values = per_job if differ == "downloads_per_job" else per_rank
    warned = [r.getMessage() for r in caplog.records if differ in r.getMessage()]
    assert len(warned) == 1
    assert all(f"{v} on ranks [{r}]" in warned[0] for r, v in enumerate(values))
