"""The start-up prefetch run by node leaders for their nodes, under ``mpirun``.

Two "nodes" of two ranks each (one ``DISTCACHE_NODE_ID`` per ``mpirun`` application
context) start through ``distcache.init``. Where each node's ranks share their
leader's pool and pass the same manifest, only the leaders plan and fetch, and each
member gets the leaders' report, or the error every rank raises, from its leader.
A member whose pool is a copy of its leader's (the same ``pool_id``, another
directory), or whose manifest differs, makes every rank run the whole collective.
Members outlive a prefetch longer than the timeout: their leader tells them it is at
work.
"""

from __future__ import annotations

import json
import re
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

WORKER = Path(__file__).with_name("init_worker.py")
K = 6
NODES = ("a", "b")


class Job:
    def __init__(self, tmp: Path, srv: LoopbackOrigin, artifacts: list[Artifact]) -> None:
        self.tmp = tmp
        self.srv = srv
        self.artifacts = artifacts
        self.mirror = tmp / "mirror"
        self.manifest = self.mirror / "checksums.txt"
        self.pools = tmp / "pools"
        self.out = tmp / "out"
        self.events = tmp / "events.jsonl"

    def launch(self, run_mpmd: Callable[..., CompletedProcess[str]],
               pools: list[Path], *, manifests: list[Path] | None = None,
               timeout: float = 60.0, env: dict[str, str] | None = None,
               torch: bool = False, extra: list[str] | None = None,
               origins: list[str] | None = None) -> list[dict[str, Any]]:
        """One rank per context: ranks 0, 1 on node a, 2, 3 on node b."""
        contexts = []
        for rank in range(4):
            argv = [sys.executable, str(WORKER), "--pool", str(pools[rank]),
                    "--manifest", str((manifests or [self.manifest] * 4)[rank]),
                    "--origin", (origins or [self.srv.url] * 4)[rank],
                    "--out", str(self.out),
                    "--timeout", str(timeout), *(["--torch"] if torch else []),
                    *(extra or [])]
            variables = {"DISTCACHE_NODE_ID": NODES[rank // 2],
                         "DISTCACHE_LOG_JSON": str(self.events), **(env or {})}
            contexts.append((1, variables, argv))
        proc = run_mpmd(contexts)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(4)]

    def copies(self, *names: str) -> str:
        """Copies (``cp -a``) of a fresh template pool under ``pools/``; its id."""
        template = self.tmp / "template"
        template_id = ArtifactPool(template).pool_id
        self.pools.mkdir()
        for name in names:
            subprocess.run(["cp", "-a", str(template), str(self.pools / name)], check=True,
                           timeout=60)
        return template_id

    def node_pools(self) -> list[Path]:
        return [self.pools / NODES[rank // 2] for rank in range(4)]

    def probes(self) -> list[dict[str, Any]]:
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == "pool.probe"]

    def complete(self, root: Path) -> bool:
        pool = ArtifactPool(root)
        return (sorted(pool.objects()) == sorted(a.sha256 for a in self.artifacts)
                and pool.verify().corrupt == 0)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    artifacts = make_artifacts(tmp_path / "mirror", K, min_size=2_000, max_size=20_000, seed=7)
    with LoopbackOrigin(tmp_path / "mirror") as srv:
        yield Job(tmp_path, srv, artifacts)


def _same_report(records: list[dict[str, Any]]) -> dict[str, Any]:
    for r in records:
        assert r["error"] is None, r["error"]
    reports = [{k: v for k, v in r["report"].items() if k != "seconds"} for r in records]
    assert all(rep == reports[0] for rep in reports), reports
    return reports[0]


@pytest.mark.parametrize("torch", [False, True], ids=["adopted", "gloo"])
def test_members_leave_the_prefetch_to_their_node_leader(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]], torch: bool
) -> None:
    records = job.launch(run_mpmd, job.node_pools(), torch=torch)

    report = _same_report(records)
    assert report["downloads"] == K and report["pools"] == 2
    assert report["writers"] == [0, 2]  # the job's ranks, not the leaders' own
    assert set(report["downloaders"]) <= {0, 2} and report["downloaders"]
    assert job.srv.requests == {a.name: 1 for a in job.artifacts}
    assert [r["planned"] for r in records] == [True, False, True, False]
    for node in NODES:
        assert job.complete(job.pools / node)
        assert sorted((job.pools / node / "tmp").glob("probe.*")) == []
    # One probe per node (the leader's, which its member found), none beyond.
    assert sorted(p["root"] for p in job.probes()) == [str(job.pools / n) for n in NODES]
    # Verified once per job: the leaders hashed each object as they published it and
    # vouched for them to their members, so no rank's loader-style read hashes again.
    assert [(r["verified"], r["hashed_reads"], r["reads_right"]) for r in records] == [
        (K, 0, True)] * 4

    job.srv.reset()
    warm_records = job.launch(run_mpmd, job.node_pools(), torch=torch)
    warm = _same_report(warm_records)
    assert warm["downloads"] == 0 and warm["pool_hits"] == K
    assert job.srv.total_requests == 0
    # Nothing was verified in this job: every read hashes its object.
    assert [(r["verified"], r["hashed_reads"], r["reads_right"]) for r in warm_records] == [
        (0, K, True)] * 4


def test_a_member_on_a_copy_of_its_leaders_pool_makes_every_rank_run_the_collective(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    job.copies("a", "a-copy", "b")
    pools = [job.pools / "a", job.pools / "a-copy", job.pools / "b", job.pools / "b"]
    assert len({ArtifactPool(p).pool_id for p in pools}) == 1  # copies: one id

    records = job.launch(run_mpmd, pools)

    report = _same_report(records)
    assert report["pools"] == 3 and report["downloads"] == K
    assert [r["planned"] for r in records] == [True] * 4
    assert job.srv.requests == {a.name: 1 for a in job.artifacts}
    for name in ("a", "a-copy", "b"):
        assert job.complete(job.pools / name), name


def test_a_member_with_another_manifest_gets_the_mismatch_like_every_rank(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    other = job.tmp / "other.txt"
    other.write_text("".join(job.manifest.read_text().splitlines(keepends=True)[:-1]))

    records = job.launch(run_mpmd, job.node_pools(),
                         manifests=[job.manifest] * 3 + [other])

    assert [r["error"][0] for r in records] == ["ManifestMismatchError"] * 4
    assert job.srv.total_requests == 0


@pytest.mark.parametrize("torch", [False, True], ids=["adopted", "gloo"])
def test_a_failure_on_the_leaders_is_raised_on_their_members(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]], torch: bool
) -> None:
    gone = job.artifacts[2]
    (job.mirror / gone.name).unlink()

    records = job.launch(run_mpmd, job.node_pools(), torch=torch)

    errors = [r["error"] for r in records]
    assert all(e is not None for e in errors), errors
    assert {e[0] for e in errors} == {"PrefetchError"}
    assert len({e[1] for e in errors}) == 1, errors  # the same error on every rank
    assert gone.name in errors[0][1]
    # The rank named is the job's (a leader: 0 or 2 of 4), not the leaders' own count.
    assert re.search(r"on rank [02]/4 \(", errors[0][1]), errors[0][1]
    assert [r["planned"] for r in records] == [True, False, True, False]


def test_members_wait_out_a_prefetch_longer_than_the_timeout(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    # One download at a time, 0.8 s each: the leaders work about 5 s, and a member
    # would give up after 2 s of silence.
    job.srv.latency = 0.8
    records = job.launch(run_mpmd, job.node_pools(), timeout=2.0,
                         env={"DISTCACHE_DOWNLOADS_PER_RANK": "1",
                              "DISTCACHE_DOWNLOADS_PER_JOB": "1"})

    report = _same_report(records)
    assert report["downloads"] == K and report["downloaders"] == [0]
    assert [r["planned"] for r in records] == [True, False, True, False]
    assert records[1]["report"]["seconds"]["fetch"] > 4.0  # twice the timeout


def test_nodes_with_different_manifests_get_the_mismatch_in_the_jobs_ranks(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    # Each node agrees with itself, so the leaders act for their nodes and find the
    # difference between them; every rank raises it, naming the job's ranks.
    other = job.tmp / "other.txt"
    other.write_text("".join(job.manifest.read_text().splitlines(keepends=True)[:-1]))

    records = job.launch(run_mpmd, job.node_pools(),
                         manifests=[job.manifest] * 2 + [other] * 2)

    assert [r["error"][0] for r in records] == ["ManifestMismatchError"] * 4
    assert len({r["error"][1] for r in records}) == 1
    # How many artifacts each side lists comes through the leaders' mapping too.
    assert re.search(rf"ranks \[0, 1\] have \w+ \({K} artifacts\)", records[0]["error"][1])
    assert re.search(rf"ranks \[2, 3\] have \w+ \({K - 1} artifacts\)", records[0]["error"][1])
    assert [r["planned"] for r in records] == [True, False, True, False]
    assert job.srv.total_requests == 0


def test_a_rank_without_an_origin_fails_the_job_alike_with_a_collective_in_between(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    # Rank 3 has no origin. The node tree the prefetch uses is made before the IPC
    # exchange on every rank, whatever its origin (the origin's set-up on the ranks
    # that have one needs it), so no rank's collectives cross another's; the prefetch
    # then finds a rank without an origin and a cold job: every rank raises the same.
    records = job.launch(run_mpmd, job.node_pools(), timeout=20.0, extra=["--ipc"],
                         env={"DISTCACHE_PEERS": "0"},
                         origins=[job.srv.url] * 3 + [""])

    assert [r["error"][0] for r in records] == ["ConfigError"] * 4, records
    assert len({r["error"][1] for r in records}) == 1
    assert job.srv.total_requests == 0


def test_members_learn_the_id_their_leader_gave_a_copied_node_pool(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    template_id = job.copies(*NODES)

    records = job.launch(run_mpmd, job.node_pools())

    _same_report(records)
    assert [r["planned"] for r in records] == [True, False, True, False]
    on_disk = [ArtifactPool(job.pools / node).pool_id for node in NODES]
    assert on_disk[0] == template_id != on_disk[1]  # node b's copy took a fresh id
    assert [r["pool_id"] for r in records] == [on_disk[0]] * 2 + [on_disk[1]] * 2


def test_mpi_below_thread_multiple_makes_every_rank_run_the_collective(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    # A leader tells its node it is at work from a second thread, which MPI allows
    # only at MPI_THREAD_MULTIPLE.
    records = job.launch(run_mpmd, job.node_pools(), extra=["--thread-level", "serialized"])

    report = _same_report(records)
    assert report["downloads"] == K
    assert [r["planned"] for r in records] == [True] * 4


def test_members_give_up_on_a_leader_whose_prefetch_makes_no_progress(
    job: Job, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    # The leaders hold their prefetch 3x the timeout before starting it, no collective
    # in flight: they stop telling their nodes they are at work, and the members raise
    # instead of waiting for them (then the leaders, their word unheard, raise too).
    records = job.launch(run_mpmd, job.node_pools(), timeout=2.0, extra=["--wedge", "6"])

    assert [r["planned"] for r in records] == [True, False, True, False]
    for member in (records[1], records[3]):
        assert member["error"] is not None and member["error"][0] == "CollectiveTimeout"
    for leader in (records[0], records[2]):
        assert leader["error"] is not None and leader["error"][0] == "CollectiveTimeout"
        assert "stopped waiting" in leader["error"][1]
