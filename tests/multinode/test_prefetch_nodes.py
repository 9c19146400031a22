"""The collective prefetch across two "nodes" of two MPI ranks each.

One MPMD ``mpirun`` launch gives each pair of ranks its own ``DISTCACHE_NODE_ID``;
pytest runs the loopback origin and counts its requests, and reads each pool's
journal to count publications. Every rank writes its report, its error if any, and
the artifact bytes it sent and received as JSON (``prefetch_worker.py``).
"""

from __future__ import annotations

import json
import re
import shutil
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
K = 6
NODES = ("a", "b")
_SHA = re.compile(r"^[0-9a-f]{64}$")

Record = dict[str, Any]


class Job:
    """The origin, its artifacts and the directories of one test."""

    def __init__(self, tmp: Path, srv: LoopbackOrigin, artifacts: list[Artifact]) -> None:
        self.tmp = tmp
        self.srv = srv
        self.artifacts = artifacts
        self.mirror = tmp / "mirror"
        self.manifest = self.mirror / "checksums.txt"
        self.pools = tmp / "pools"
        self.out = tmp / "out"
        self.shas = sorted(a.sha256 for a in artifacts)
        self.total_bytes = sum(len(self.data(a)) for a in artifacts)

    def data(self, artifact: Artifact) -> bytes:
        return (self.mirror / artifact.name).read_bytes()

    def pool(self, name: str) -> ArtifactPool:
        return ArtifactPool(self.pools / name)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    artifacts = make_artifacts(tmp_path / "mirror", K, min_size=2_000, max_size=40_000, seed=11)
    with LoopbackOrigin(tmp_path / "mirror") as srv:
        yield Job(tmp_path, srv, artifacts)


def _launch(
    run_mpmd: Callable[..., CompletedProcess[str]], job: Job, layout: str, *extra: str
) -> list[Record]:
    argv = [
        sys.executable,
        str(WORKER),
        "--comm",
        "mpi",
        "--pools",
        str(job.pools),
        "--layout",
        layout,
        "--origin",
        job.srv.url,
        "--manifest",
        str(job.manifest),
        "--out",
        str(job.out),
        *extra,
    ]
    shutil.rmtree(job.out, ignore_errors=True)
    proc = run_mpmd([(2, {"DISTCACHE_NODE_ID": node}, argv) for node in NODES])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads((job.out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["rank"], r["size"], r["node_id"]) for r in records] == [
        (0, 4, "a"),
        (1, 4, "a"),
        (2, 4, "b"),
        (3, 4, "b"),
    ]
    return records


def _same_report(records: list[Record], attempt: str = "prefetch") -> Record:
    """The report every rank returned (asserting they are identical, seconds aside)."""
    reports = []
    for r in records:
        assert r[attempt]["error"] is None, r[attempt]["error"]
        reports.append({k: v for k, v in r[attempt]["report"].items() if k != "seconds"})
    assert all(rep == reports[0] for rep in reports), reports
    return reports[0]


def _publications(pool: ArtifactPool) -> list[str]:
    """Every publication record in the pool's journal, repeats included."""
    lines = (pool.root / "journal.log").read_text().split("\n")
    return [line for line in lines if _SHA.match(line)]


def _assert_complete(job: Job, pool: ArtifactPool) -> None:
    assert sorted(pool.objects()) == job.shas
    assert pool.names() == {a.name: a.sha256 for a in job.artifacts}
    checked = pool.verify()
    assert (checked.ok, checked.corrupt, checked.quarantined) == (K, 0, 0)
    assert checked.ok_bytes == job.total_bytes


def _assert_published_once(job: Job, pool: ArtifactPool) -> None:
    shas, _ = pool.journal_since(0)
    assert sorted(shas) == job.shas
    assert sorted(_publications(pool)) == job.shas


def test_node_local_pools_fetch_each_artifact_once_and_write_each_pool_once(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    records = _launch(run_mpmd, job, "node")

    assert job.srv.total_requests == K
    assert job.srv.requests == {a.name: 1 for a in job.artifacts}
    report = _same_report(records)
    assert report["downloads"] == K and report["origin_bytes"] == job.total_bytes
    assert report["pools"] == 2 and report["writers"] == [0, 2]
    assert report["pool_hits"] == 0
    assert report["objects_published"] == 2 * K
    # Each object is missing from exactly one other pool, so it crosses once.
    assert report["received_bytes"] == job.total_bytes and report["discarded_bytes"] == 0
    for node in NODES:
        pool = job.pool(node)
        _assert_published_once(job, pool)
        _assert_complete(job, pool)
    # Only the writers take part in moving bytes, both ways; with two pools every
    # bucket has exactly one receiver. (Buckets carry a small table besides the
    # artifact bytes, hence ">=".)
    sent = [r["prefetch"]["sent_bytes"] for r in records]
    received = [r["prefetch"]["received_bytes"] for r in records]
    assert sent[1] == sent[3] == received[1] == received[3] == 0
    assert sent[0] > 0 and sent[2] > 0
    assert sum(sent) == sum(received) == report["broadcast_bytes"] >= job.total_bytes


def test_a_warm_node_feeds_the_cold_one_without_touching_the_origin(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    warm = job.pool("a")
    for a in job.artifacts:
        warm.put(job.data(a), a.sha256)
    warm.remember(job.artifacts)

    records = _launch(run_mpmd, job, "node")

    assert job.srv.total_requests == 0
    report = _same_report(records)
    assert report["downloads"] == 0 and report["downloaders"] == []
    assert report["pool_hits"] == 0 and report["objects_published"] == K
    assert report["received_bytes"] == job.total_bytes and report["discarded_bytes"] == 0
    # Node a's ranks receive nothing; its writer sends every bucket once, and node b's
    # writer alone receives them (artifact bytes plus each bucket's small table).
    moved = report["broadcast_bytes"]
    assert moved >= job.total_bytes
    assert [r["prefetch"]["received_bytes"] for r in records] == [0, 0, moved, 0]
    assert [r["prefetch"]["sent_bytes"] for r in records] == [moved, 0, 0, 0]
    _assert_published_once(job, warm)  # the import only: nothing published again
    _assert_published_once(job, job.pool("b"))
    for node in NODES:
        _assert_complete(job, job.pool(node))


def test_one_shared_pool_has_one_writer_and_each_object_is_published_once(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    records = _launch(run_mpmd, job, "shared")

    assert job.srv.total_requests == K
    assert job.srv.requests == {a.name: 1 for a in job.artifacts}
    report = _same_report(records)
    assert report["pools"] == 1 and report["writers"] == [0]
    assert report["downloads"] == K and report["objects_published"] == K
    # Downloads land in the pool every rank reads: nothing to move.
    assert report["broadcast_bytes"] == 0 and report["received_bytes"] == 0
    assert {r["pool"] for r in records} == {str(job.pools / "shared")}
    pool = job.pool("shared")
    _assert_published_once(job, pool)
    _assert_complete(job, pool)


def test_wrong_bytes_from_the_origin_fail_every_rank_alike_and_keep_the_good_objects(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    bad = job.artifacts[K // 2]
    job.srv.inject("wrong_bytes", path=bad.name, count=None)

    records = _launch(run_mpmd, job, "node")

    errors = [r["prefetch"]["error"] for r in records]
    assert all(r["prefetch"]["report"] is None for r in records)
    assert {e["type"] for e in errors} == {"PrefetchError"}
    assert {e["artifact"] for e in errors} == {bad.name}
    assert all(bad.name in e["message"] for e in errors)
    assert len({e["message"] for e in errors}) == 1, errors
    # One request per artifact: the bad one was refused, not retried.
    assert job.srv.requests == {a.name: 1 for a in job.artifacts}
    # Each good object was published whole into the pool of the node that fetched it
    # (and maybe moved on before the failure: the move runs beside the downloads); the
    # bad one reached no pool.
    good = {a.sha256 for a in job.artifacts if a is not bad}
    held: set[str] = set()
    for node in NODES:
        pool = job.pool(node)
        objects = sorted(pool.objects())
        assert bad.sha256 not in objects
        checked = pool.verify()
        assert (checked.ok, checked.corrupt) == (len(objects), 0)
        assert sorted(_publications(pool)) == objects
        held |= set(objects)
    assert held == good

    # The next job resumes from what was published: only the bad artifact is fetched.
    job.srv.reset()
    records = _launch(run_mpmd, job, "node")
    report = _same_report(records)
    assert job.srv.requests == {bad.name: 1}
    assert report["downloads"] == 1
    for node in NODES:
        _assert_published_once(job, job.pool(node))
        _assert_complete(job, job.pool(node))
