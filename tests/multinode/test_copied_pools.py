"""Two "nodes" whose node-local pools are copies of one template, under ``mpirun``.

A warm pool baked into an image, or rsync'd to each node's disk, keeps its template's
``pool_id``. The ranks must not take the two copies for one shared pool: each node's
pool must end up holding every artifact, the copy that did not show the first probe
takes a fresh id, and the next run pays no more than one probe per pool and asks the
origin for nothing. A pool every rank really shares still has one writer and
downloads each artifact once.

The probes are counted from the ``pool.probe`` events each rank appends to
``DISTCACHE_LOG_JSON``; the requests by the loopback origin pytest runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.store._pool import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts

WORKER = Path(__file__).with_name("prefetch_worker.py")
K = 4
NODES = ("a", "b")


class Job:
    """The origin, the template pool and the directories of one test."""

    def __init__(self, tmp: Path, srv: LoopbackOrigin, artifacts: list[Artifact]) -> None:
        self.tmp = tmp
        self.srv = srv
        self.artifacts = artifacts
        self.mirror = tmp / "mirror"
        self.pools = tmp / "pools"
        self.out = tmp / "out"
        self.events = tmp / "events.jsonl"
        self.template = tmp / "template"
        pool = ArtifactPool(self.template)
        first = artifacts[0]
        pool.put((self.mirror / first.name).read_bytes(), first.sha256)
        pool.remember([first])
        self.template_id = pool.pool_id

    def copy_template(self, name: str) -> Path:
        self.pools.mkdir(exist_ok=True)
        target = self.pools / name
        subprocess.run(["cp", "-a", str(self.template), str(target)], check=True, timeout=60)
        return target

    def launch(self, run_mpmd: Callable[..., CompletedProcess[str]],
               layout: str) -> list[dict[str, Any]]:
        argv = [sys.executable, str(WORKER), "--comm", "mpi", "--pools", str(self.pools),
                "--layout", layout, "--origin", self.srv.url,
                "--manifest", str(self.mirror / "checksums.txt"), "--out", str(self.out)]
        self.events.unlink(missing_ok=True)
        proc = run_mpmd([(2, {"DISTCACHE_NODE_ID": node, "DISTCACHE_LOG_JSON": str(self.events)},
                          argv) for node in NODES])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        records = [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(4)]
        for r in records:
            assert r["prefetch"]["error"] is None, r["prefetch"]["error"]
        return records

    def events_named(self, event: str) -> list[dict[str, Any]]:
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == event]

    def complete(self, root: Path) -> bool:
        pool = ArtifactPool(root)
        return (sorted(pool.objects()) == sorted(a.sha256 for a in self.artifacts)
                and pool.names() == {a.name: a.sha256 for a in self.artifacts}
                and pool.verify().corrupt == 0)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    artifacts = make_artifacts(tmp_path / "mirror", K, min_size=2_000, max_size=20_000, seed=5)
    with LoopbackOrigin(tmp_path / "mirror") as srv:
        yield Job(tmp_path, srv, artifacts)


def _report(records: list[dict[str, Any]]) -> dict[str, Any]:
    reports = [{k: v for k, v in r["prefetch"]["report"].items() if k != "seconds"}
               for r in records]
    assert all(rep == reports[0] for rep in reports), reports
    return reports[0]


def _probe_files(root: Path) -> list[Path]:
    return sorted((root / "tmp").glob("probe.*"))


def test_copied_node_local_pools_each_get_every_artifact_and_then_cost_one_probe_each(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    roots = [job.copy_template(node) for node in NODES]
    assert len({ArtifactPool(r).pool_id for r in roots}) == 1  # copies: one id

    first = _report(job.launch(run_mpmd, "node"))

    assert first["pools"] == 2 and first["writers"] == [0, 2]
    assert job.srv.requests == {a.name: 1 for a in job.artifacts[1:]}
    for root in roots:
        assert job.complete(root), f"{root.name} holds {len(list(ArtifactPool(root).objects()))}"
        assert _probe_files(root) == []
    ids = [ArtifactPool(r).pool_id for r in roots]
    assert ids[0] == job.template_id != ids[1]  # node a showed the first probe
    assert [e["old"] for e in job.events_named("pool.renewed")] == [job.template_id]

    job.srv.reset()
    second = _report(job.launch(run_mpmd, "node"))

    assert job.srv.total_requests == 0
    assert second["downloads"] == 0 and second["pools"] == 2
    assert second["broadcast_bytes"] == 0
    probes = job.events_named("pool.probe")
    assert sorted(p["root"] for p in probes) == sorted(str(r) for r in roots)
    assert job.events_named("pool.renewed") == []
    assert [ArtifactPool(r).pool_id for r in roots] == ids
    for root in roots:
        assert _probe_files(root) == []


def test_a_pool_every_rank_shares_still_has_one_writer_and_downloads_once(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    root = job.copy_template("shared")

    report = _report(job.launch(run_mpmd, "shared"))

    assert report["pools"] == 1 and report["writers"] == [0]
    assert report["downloads"] == K - 1 and report["broadcast_bytes"] == 0
    assert job.srv.requests == {a.name: 1 for a in job.artifacts[1:]}
    assert job.complete(root) and _probe_files(root) == []
    assert ArtifactPool(root).pool_id == job.template_id
    assert len(job.events_named("pool.probe")) == 1
    assert job.events_named("pool.renewed") == []
