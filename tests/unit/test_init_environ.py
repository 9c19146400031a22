"""``init(environ=...)`` reaches every layer of the start-up: the download counts it
gives decide which node leaders download and with how many threads, in the leaders'
prefetch and in the one over every rank, and its ``DISTCACHE_OFFLINE=1`` makes no
request, whatever the process's own environment says."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.comm import NodeTree, ThreadGroup
from distcache.errors import ConfigError
from distcache.session import Session, SessionSlot
from distcache.store import ArtifactPool
from tests.support.helpers import isolated_init, on_threads

TIMEOUT = 20.0
#: Seconds a gated request waits for the others before the gate opens for good.
GATE_WAIT = 5.0


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


class Counting:
    """An origin that counts its requests, its set-ups and the most requests in flight
    at once. With ``gate`` > 1 a request waits until that many are in flight (or until
    one wait has run out, after which none waits), so the count shows the threads."""

    def __init__(self, blobs: dict[str, bytes], gate: int = 1) -> None:
        self.blobs, self.gate = blobs, gate
        self.requests = self.prepared = self.now = self.most = 0
        self._cond = threading.Condition()
        self._open = gate <= 1

    def describe(self) -> str:
        return "counting://origin"

    def prepare(self) -> None:
        with self._cond:
            self.prepared += 1

    def fetch(self, artifact: Artifact) -> bytes:
        with self._cond:
            self.requests += 1
            self.now += 1
            self.most = max(self.most, self.now)
            if self.now >= self.gate:
                self._open = True
                self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._open, timeout=GATE_WAIT):
                self._open = True
                self._cond.notify_all()
        try:
            return self.blobs[artifact.sha256]
        finally:
            with self._cond:
                self.now -= 1

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        data = self.fetch(artifact)
        out.write(data)
        return len(data)


def _artifacts(count: int) -> tuple[list[Artifact], dict[str, bytes]]:
    listed, blobs = [], {}
    for i in range(count):
        data = b"kernel %d " % i * 50
        sha = sha256_hex(data)
        listed.append(Artifact(f"cubins/k{i:02d}.cubin", sha, len(data)))
        blobs[sha] = data
    return listed, blobs


def _start(tmp_path: Path, nodes: int, per_node: int, origins: list[Counting],
           listed: list[Artifact], environ: dict[str, str]) -> list[Any]:
    """``init`` on ``nodes`` simulated nodes of ``per_node`` ranks each, a pool per
    node, rank r asking ``origins[r]``; each rank's session or error (sessions closed).
    The ranks' node tree is made as for ranks in processes of their own (in-process
    ranks get none), so that node leaders act for their nodes."""
    size = nodes * per_node
    group = ThreadGroup(size, [f"node{r // per_node}" for r in range(size)], timeout=TIMEOUT)
    out = on_threads(size, lambda r: SessionSlot().init(
        comm=NodeTree(group.comm(r), timeout=TIMEOUT).selected(),
        pool=tmp_path / f"pool{r // per_node}", origin=origins[r], manifests=[listed], integrations=(), timeout=TIMEOUT,
        environ={"DISTCACHE_PEERS": "0", **environ}))
    for result in out:
        if isinstance(result, Session):
            result.close()
    return out


def _pools_hold(tmp_path: Path, nodes: int, listed: list[Artifact]) -> bool:
    return all(ArtifactPool(tmp_path / f"pool{n}").has(a.sha256)
               for n in range(nodes) for a in listed)


def test_the_job_count_in_environ_decides_how_many_leaders_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process would let every leader download with many threads; the environ
    # given to init allows one connection for the job: the first leader alone.
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_RANK", "4")
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_JOB", "64")
    listed, blobs = _artifacts(16)
    origins = [Counting(blobs) for _ in range(8)]
    out = _start(tmp_path, 4, 2, origins, listed, {"DISTCACHE_DOWNLOADS_PER_RANK": "1",
                                                   "DISTCACHE_DOWNLOADS_PER_JOB": "1"})
    assert all(isinstance(s, Session) for s in out), out
    assert [o.requests for o in origins] == [16] + [0] * 7
    assert origins[0].most == 1
    # Only the leader that downloads set its client up ahead of the downloads.
    assert [o.prepared for o in origins] == [1] + [0] * 7
    assert _pools_hold(tmp_path, 4, listed)


def test_the_rank_count_in_environ_decides_a_leaders_download_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process says one download at a time; the environ gives the job three, on
    # one leader (its node's ranks' connections, within the job's).
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_RANK", "1")
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_JOB", "1")
    listed, blobs = _artifacts(12)
    origins = [Counting(blobs, gate=3) for _ in range(4)]
    out = _start(tmp_path, 2, 2, origins, listed, {"DISTCACHE_DOWNLOADS_PER_RANK": "3",
                                                   "DISTCACHE_DOWNLOADS_PER_JOB": "3"})
    assert all(isinstance(s, Session) for s in out), out
    assert [o.requests for o in origins] == [12, 0, 0, 0]
    assert origins[0].most == 3
    assert _pools_hold(tmp_path, 2, listed)


def test_the_counts_in_environ_reach_a_prefetch_without_leaders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One rank per node: no leader acts for others, every rank takes the collective.
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_RANK", "4")
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_JOB", "64")
    listed, blobs = _artifacts(12)
    origins = [Counting(blobs) for _ in range(3)]
    out = _start(tmp_path, 3, 1, origins, listed, {"DISTCACHE_DOWNLOADS_PER_RANK": "1",
                                                   "DISTCACHE_DOWNLOADS_PER_JOB": "1"})
    assert all(isinstance(s, Session) for s in out), out
    assert sorted(o.requests for o in origins) == [0, 0, 12]
    assert max(o.most for o in origins) == 1
    assert _pools_hold(tmp_path, 3, listed)


@pytest.mark.parametrize("per_node", [1, 2])
def test_offline_in_environ_makes_no_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_node: int
) -> None:
    monkeypatch.setenv("DISTCACHE_OFFLINE", "0")
    listed, blobs = _artifacts(6)
    size = 2 * per_node
    origins = [Counting(blobs) for _ in range(size)]
    offline = {"DISTCACHE_OFFLINE": "1"}
    # Cold pools: one error on every rank, naming the setting; no request, no set-up.
    out = _start(tmp_path, 2, per_node, origins, listed, offline)
    assert all(isinstance(e, ConfigError) for e in out), out
    assert all("DISTCACHE_OFFLINE" in str(e) for e in out)
    assert [o.requests + o.prepared for o in origins] == [0] * size
    # One node's pool holds everything: it reaches the other's, still without a request.
    warm = ArtifactPool(tmp_path / "pool0")
    for a in listed:
        warm.put(blobs[a.sha256], a.sha256)
    out = _start(tmp_path, 2, per_node, origins, listed, offline)
    assert all(isinstance(s, Session) for s in out), out
    assert [o.requests + o.prepared for o in origins] == [0] * size
    assert _pools_hold(tmp_path, 2, listed)


def test_the_leaders_counts_follow_the_settings_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache._prepare import leader_downloaders
    from distcache.comm import Communicator
    from distcache.config import settings

    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_RANK", "4")
    monkeypatch.setenv("DISTCACHE_DOWNLOADS_PER_JOB", "64")
    conf = settings({"DISTCACHE_DOWNLOADS_PER_RANK": "2", "DISTCACHE_DOWNLOADS_PER_JOB": "4"})
    group = ThreadGroup(12, [f"n{r // 2}" for r in range(12)], timeout=TIMEOUT)

    def counts(comm: Communicator) -> tuple[int, int]:
        tree = NodeTree(comm)
        return leader_downloaders(tree), leader_downloaders(tree, conf)

    # The process's settings when none are given (8 threads a leader: 8 leaders carry
    # the job's 64, every one of the 6 downloads), else those given (2 threads a
    # leader: 2 leaders carry the job's 4).
    assert on_threads(12, lambda r: counts(group.comm(r))) == [(8, 2)] * 12
