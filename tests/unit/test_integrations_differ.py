"""The start-up prefetch when the ranks' integrations differ (FlashInfer's is kept only
where it is installed): every rank runs the same collectives, and a rank without
integrations takes part, contributing nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distcache._prepare import set_up_where_downloading
from distcache._resolve import prefetch_manifests
from distcache.artifact import Artifact, manifest_text
from distcache.collective import PrefetchReport
from distcache.comm import Communicator, ThreadGroup
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.threads import AsProcesses, Wanting, run_ranks

TIMEOUT = 20.0


def _two(tmp_path: Path) -> tuple[Artifact, Artifact, DirOrigin]:
    root = tmp_path / "origin"
    listed, wanted = make_artifacts(root, 2, min_size=1_000, max_size=4_000, seed=3)
    return listed, wanted, DirOrigin(root)


def _check(results: list[Any], pools: list[ArtifactPool], artifacts: list[Artifact]) -> None:
    for result in results:
        assert isinstance(result, PrefetchReport), result
    for pool in pools:
        assert all(pool.has(a.sha256) for a in artifacts), pool.root


def test_an_integration_on_one_rank_only_with_the_same_manifest_everywhere(
    tmp_path: Path,
) -> None:
    listed, wanted, origin = _two(tmp_path)
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(manifest_text([listed]))
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    group = ThreadGroup(2, timeout=TIMEOUT)

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(
            comm, pools[comm.rank], origin, manifests=[manifest], timeout=TIMEOUT,
            integrations=[Wanting([wanted])] if comm.rank == 0 else [], offline=False)

    _check(run_ranks(group, body), pools, [listed, wanted])


def test_an_integration_on_one_rank_only_and_no_manifests(tmp_path: Path) -> None:
    _listed, wanted, origin = _two(tmp_path)
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    group = ThreadGroup(2, timeout=TIMEOUT)

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(
            comm, pools[comm.rank], origin, timeout=TIMEOUT,
            integrations=[Wanting([wanted])] if comm.rank == 1 else [], offline=False)

    _check(run_ranks(group, body), pools, [wanted])


def test_with_nothing_anywhere_every_rank_returns_none(tmp_path: Path) -> None:
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    group = ThreadGroup(2, timeout=TIMEOUT)
    results = run_ranks(group, lambda comm: prefetch_manifests(
        comm, pools[comm.rank], None, timeout=TIMEOUT))
    assert results == [None, None]


def test_nodes_whose_integrations_differ_make_the_tree_and_prefetch_alike(
    tmp_path: Path,
) -> None:
    """As the session runs it: the origin's set-up (where the node tree is made), a
    collective of its own, then the prefetch. Node 0's ranks have the integration,
    node 1's none: each node's leader acts for it, and node 1's joins the leaders."""
    _listed, wanted, origin = _two(tmp_path)
    pools = [ArtifactPool(tmp_path / f"pool-{n}") for n in range(2)]  # one per node
    group = ThreadGroup(4, [f"n{r // 2}" for r in range(4)], timeout=TIMEOUT)

    def body(base: Communicator) -> Any:
        comm = AsProcesses(base)
        pool = pools[comm.rank // 2]
        integrations = [Wanting([wanted])] if comm.rank < 2 else []
        thread = set_up_where_downloading(comm, pool, origin, [], integrations, False,
                                          TIMEOUT)
        if thread is not None:
            thread.join(TIMEOUT)
        said = comm.allgather_object(("between", comm.rank), timeout=TIMEOUT)
        assert said == [("between", r) for r in range(4)], said
        return prefetch_manifests(comm, pool, origin, integrations=integrations,
                                  timeout=TIMEOUT, offline=False, set_up=False)

    _check(run_ranks(group, body, limit=90), pools, [wanted])
