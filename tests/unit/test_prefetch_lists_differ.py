"""The start-up prefetch where the ranks' manifests differ: every rank raises the same
ManifestMismatchError at once, whether a rank lists nothing, the job has no origin (the
pools are asked what they hold, by position in the list) or node leaders would act for
their nodes; lists that differ only before merging (order, an artifact one rank lists
and another's integration wants) still prefetch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distcache._resolve import prefetch_manifests
from distcache.artifact import Artifact, manifest_text
from distcache.collective import PrefetchReport
from distcache.comm import Communicator, ThreadGroup
from distcache.errors import ManifestMismatchError
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.threads import AsProcesses, Wanting, run_ranks

# Long enough that a rank left waiting would show as a timeout, not a mismatch.
TIMEOUT = 15.0


def _setup(tmp_path: Path, count: int = 3) -> tuple[list[Artifact], DirOrigin]:
    root = tmp_path / "origin"
    artifacts = make_artifacts(root, count, min_size=500, max_size=2_000, seed=11)
    return artifacts, DirOrigin(root)


def _manifest(tmp_path: Path, name: str, artifacts: list[Artifact]) -> Path:
    path = tmp_path / name
    path.write_text(manifest_text(artifacts))
    return path


def _all_mismatch(results: list[Any], pools: list[ArtifactPool],
                  artifacts: list[Artifact]) -> None:
    for rank, result in enumerate(results):
        assert isinstance(result, ManifestMismatchError), (rank, result)
    for pool in pools:
        assert not any(pool.has(a.sha256) for a in artifacts), pool.root


@pytest.mark.parametrize("with_origin", [True, False])
def test_a_rank_listing_nothing_fails_every_rank_at_once(tmp_path: Path,
                                                         with_origin: bool) -> None:
    artifacts, origin = _setup(tmp_path)
    full = _manifest(tmp_path, "full.txt", artifacts)
    empty = _manifest(tmp_path, "empty.txt", [])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(3)]
    group = ThreadGroup(3, timeout=TIMEOUT)

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(
            comm, pools[comm.rank], origin if with_origin else None, timeout=TIMEOUT,
            manifests=[empty if comm.rank == 2 else full], offline=False)

    results = run_ranks(group, body)
    _all_mismatch(results, pools, artifacts)
    assert "(0 artifacts)" in str(results[0])


def test_without_an_origin_lists_of_one_length_that_differ_fail_alike(
    tmp_path: Path,
) -> None:
    """The pools are asked what they hold by position: a rank whose list holds other
    artifacts must not read another's answers as its own."""
    artifacts, _ = _setup(tmp_path, 4)
    one = _manifest(tmp_path, "one.txt", artifacts[:3])
    other = _manifest(tmp_path, "other.txt", artifacts[1:])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    for a in artifacts[1:3]:  # what both lists share is held; the rest is in no pool
        pools[0].put((tmp_path / "origin" / a.name).read_bytes(), a.sha256)
    group = ThreadGroup(2, timeout=TIMEOUT)

    results = run_ranks(group, lambda comm: prefetch_manifests(
        comm, pools[comm.rank], None, timeout=TIMEOUT,
        manifests=[one if comm.rank == 0 else other], offline=True))
    for rank, result in enumerate(results):
        assert isinstance(result, ManifestMismatchError), (rank, result)
    assert not pools[1].has(artifacts[1].sha256)


def test_a_node_member_listing_nothing_fails_the_job_at_once(tmp_path: Path) -> None:
    artifacts, origin = _setup(tmp_path)
    full = _manifest(tmp_path, "full.txt", artifacts)
    empty = _manifest(tmp_path, "empty.txt", [])
    pools = [ArtifactPool(tmp_path / f"pool-{n}") for n in range(2)]  # one per node
    group = ThreadGroup(4, [f"n{r // 2}" for r in range(4)], timeout=TIMEOUT)

    def body(base: Communicator) -> Any:
        comm = AsProcesses(base)
        return prefetch_manifests(comm, pools[comm.rank // 2], origin, timeout=TIMEOUT,
                                  manifests=[empty if comm.rank == 3 else full],
                                  offline=False)

    _all_mismatch(run_ranks(group, body, limit=90), pools, artifacts)


def test_lists_equal_once_merged_still_prefetch(tmp_path: Path) -> None:
    """Another order on one rank, and an artifact one rank lists that the other's
    integration wants: the merged lists are equal, so the prefetch goes on."""
    artifacts, origin = _setup(tmp_path)
    forward = _manifest(tmp_path, "forward.txt", artifacts)
    backward = _manifest(tmp_path, "backward.txt", artifacts[::-1][:2])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    group = ThreadGroup(2, timeout=TIMEOUT)

    def body(comm: Communicator) -> Any:
        first = comm.rank == 0
        return prefetch_manifests(
            comm, pools[comm.rank], origin, timeout=TIMEOUT,
            manifests=[forward if first else backward],
            integrations=[] if first else [Wanting([artifacts[0]])], offline=False)

    for result in run_ranks(group, body):
        assert isinstance(result, PrefetchReport), result
    for pool in pools:
        assert all(pool.has(a.sha256) for a in artifacts), pool.root
