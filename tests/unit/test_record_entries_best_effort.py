"""A usage record is a hint: an entry that the origin does not have, or that no pool
of the job holds where nothing may be downloaded, is left out of the start-up
prefetch with one warning on rank 0, while what a manifest lists stays required.

FlashInfer's record lists every kernel any process sharing its directory loaded,
including kernels served from the installed cubin wheel or a peer; after a switch
to a mirror that lacks one, the start-up must still succeed on every rank alike."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache._resolve import prefetch_manifests
from distcache.artifact import Artifact, sha256_hex
from distcache.collective import PrefetchReport
from distcache.comm import Communicator, ThreadGroup
from distcache.errors import ConfigError, PrefetchError
from distcache.integrations.flashinfer import FlashInfer
from distcache.integrations.flashinfer._record import Recorder
from distcache.origins import DirOrigin
from distcache.session import Session, SessionSlot
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.helpers import PlainIntegration, isolated_init, on_threads
from tests.support.threads import AsProcesses, run_ranks

TIMEOUT = 20.0
LEFT_OUT = "out of the prefetch that only a usage record lists"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


def _gone(name: str) -> Artifact:
    """An artifact that no origin and no pool of the test has."""
    return Artifact(name, sha256_hex(name.encode()))


def _record(directory: Path, artifacts: list[Artifact]) -> Path:
    """A FlashInfer usage record that lists ``artifacts``."""
    recorder = Recorder(directory, "host-1.txt")
    for artifact in artifacts:
        recorder.add(artifact.name, artifact.sha256)
    recorder.close()
    return directory


def _present(tmp_path: Path) -> tuple[Artifact, DirOrigin]:
    """One artifact in a mirror directory, and that mirror."""
    root = tmp_path / "origin"
    (present,) = make_artifacts(root, 1, min_size=1_000, max_size=4_000, seed=5)
    return present, DirOrigin(root)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and LEFT_OUT in r.getMessage()]


class Recorded(PlainIntegration):
    """What ``init`` is given in place of FlashInfer (whose install would wrap the
    process's one FlashInfer loader from every thread-rank): its usage record only."""

    name = "flashinfer"

    def __init__(self, record: Path) -> None:
        self.flashinfer = FlashInfer(record)

    def manifest(self) -> list[Artifact]:
        return self.flashinfer.manifest()

    def install(self, pool: object, origin: object) -> None:
        pass

    def uninstall(self) -> None:
        pass


def _layout(tmp_path: Path, nodes: bool) -> tuple[ThreadGroup, list[ArtifactPool], Any]:
    """Two ranks with a pool each, or two nodes of two ranks with a pool per node whose
    leaders prefetch for them: the group, the pools and ``rank -> (comm, pool)``."""
    if not nodes:
        pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
        return (ThreadGroup(2, timeout=TIMEOUT), pools,
                lambda comm: (comm, pools[comm.rank]))
    pools = [ArtifactPool(tmp_path / f"pool-{n}") for n in range(2)]
    return (ThreadGroup(4, [f"n{r // 2}" for r in range(4)], timeout=TIMEOUT), pools,
            lambda comm: (AsProcesses(comm), pools[comm.rank // 2]))


@pytest.mark.parametrize("nodes", [False, True], ids=["two-ranks", "two-nodes-of-two"])
def test_a_recorded_entry_the_origin_lacks_is_left_out_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, nodes: bool,
) -> None:
    present, origin = _present(tmp_path)
    gone = _gone("pin/gone.cubin")
    record = _record(tmp_path / "rec", [present, gone])
    group, pools, place = _layout(tmp_path, nodes)

    def body(base: Communicator) -> Any:
        comm, pool = place(base)
        return prefetch_manifests(comm, pool, origin, integrations=[FlashInfer(record)],
                                  timeout=TIMEOUT, offline=False)

    with caplog.at_level(logging.WARNING):
        results = run_ranks(group, body, limit=90)
    for result in results:
        assert isinstance(result, PrefetchReport), result
    for pool in pools:
        assert pool.has(present.sha256) and not pool.has(gone.sha256), pool.root
    (warning,) = _warnings(caplog)
    assert gone.name in warning and present.name not in warning
    assert "the origin does not have" in warning and "FlashInfer" in warning


def test_init_starts_on_every_rank_with_a_recorded_entry_the_origin_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    present, origin = _present(tmp_path)
    gone = _gone("pin/gone.cubin")
    record = _record(tmp_path / "rec", [present, gone])
    group = ThreadGroup(2, ["node-a", "node-b"], timeout=TIMEOUT)
    with caplog.at_level(logging.WARNING):
        out = on_threads(2, lambda rank: SessionSlot().init(
            comm=group.comm(rank), pool=tmp_path / f"pool-{rank}", origin=origin,
            integrations=[Recorded(record)], timeout=TIMEOUT,
            environ={"DISTCACHE_PEERS": "0"}))
    try:
        for session in out:
            assert isinstance(session, Session), session
            assert session.report is not None and session.report.artifacts == 1
    finally:
        for session in out:
            if isinstance(session, Session):
                session.close()
    for rank in range(2):
        assert ArtifactPool(tmp_path / f"pool-{rank}").has(present.sha256)
    (warning,) = _warnings(caplog)
    assert gone.name in warning


def test_the_same_entry_listed_in_a_manifest_still_fails_on_every_rank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    present, origin = _present(tmp_path)
    gone = _gone("pin/gone.cubin")
    record = _record(tmp_path / "rec", [present, gone])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(comm, pools[comm.rank], origin, manifests=[[gone]],
                                  integrations=[FlashInfer(record)], timeout=TIMEOUT,
                                  offline=False)

    with caplog.at_level(logging.WARNING):
        results = run_ranks(ThreadGroup(2, timeout=TIMEOUT), body)
    for result in results:
        assert isinstance(result, PrefetchError), result
        assert result.artifact == gone.name and "ArtifactNotFound" in str(result)
    assert {str(r) for r in results} == {str(results[0])}
    assert _warnings(caplog) == []


@pytest.mark.parametrize("offline", [False, True], ids=["no-origin", "offline"])
def test_without_downloads_a_recorded_entry_no_pool_holds_is_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    offline: bool,
) -> None:
    present, origin = _present(tmp_path)
    gone = _gone("pin/gone.cubin")
    record = _record(tmp_path / "rec", [present, gone])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    pools[1].put((tmp_path / "origin" / present.name).read_bytes())  # held on one rank
    if offline:
        monkeypatch.setenv("DISTCACHE_OFFLINE", "1")

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(comm, pools[comm.rank], origin if offline else None,
                                  integrations=[FlashInfer(record)], timeout=TIMEOUT,
                                  offline=offline)

    with caplog.at_level(logging.WARNING):
        results = run_ranks(ThreadGroup(2, timeout=TIMEOUT), body)
    for result in results:
        assert isinstance(result, PrefetchReport), result
    assert all(pool.has(present.sha256) for pool in pools)
    (warning,) = _warnings(caplog)
    assert gone.name in warning and present.name not in warning
    assert ("DISTCACHE_OFFLINE=1" if offline else "no origin is set") in warning


def test_without_an_origin_a_listed_artifact_no_pool_holds_is_still_an_error(
    tmp_path: Path,
) -> None:
    present, _origin = _present(tmp_path)
    gone, listed = _gone("pin/gone.cubin"), _gone("pin/listed.cubin")
    record = _record(tmp_path / "rec", [present, gone])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    pools[0].put((tmp_path / "origin" / present.name).read_bytes())

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(comm, pools[comm.rank], None, manifests=[[listed]],
                                  integrations=[FlashInfer(record)], timeout=TIMEOUT,
                                  offline=False)

    results = run_ranks(ThreadGroup(2, timeout=TIMEOUT), body)
    for result in results:
        assert isinstance(result, ConfigError), result
        text = str(result)
        assert "1 artifact(s) are in no pool" in text, text
        assert listed.name in text and gone.name not in text, text
    assert {str(r) for r in results} == {str(results[0])}


def _runs_leaving_out(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                      monkeypatch: pytest.MonkeyPatch, gone: list[Artifact]) -> list[int]:
    """The collective runs each of two ranks made for a prefetch of a record listing one
    artifact the origin has and ``gone``, which it lacks: each rank's report counts one
    artifact, every pool holds it, and one warning names every one of ``gone``."""
    import distcache._resolve as resolve

    present, origin = _present(tmp_path)
    record = _record(tmp_path / "rec", [present, *gone])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    runs = [0, 0]
    collective = resolve.collective_prefetch

    def counted(artifacts: Any, **given: Any) -> PrefetchReport:
        runs[given["comm"].rank] += 1
        return collective(artifacts, **given)

    monkeypatch.setattr(resolve, "collective_prefetch", counted)

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(comm, pools[comm.rank], origin,
                                  integrations=[FlashInfer(record)], timeout=TIMEOUT,
                                  offline=False)

    with caplog.at_level(logging.WARNING):
        results = run_ranks(ThreadGroup(2, timeout=TIMEOUT), body)
    for result in results:
        assert isinstance(result, PrefetchReport), result
        assert result.artifacts == 1
    assert all(pool.has(present.sha256) for pool in pools)
    (warning,) = _warnings(caplog)
    assert f"left {len(gone)} artifact(s)" in warning
    assert all(g.name in warning for g in gone)
    return runs


def test_two_recorded_entries_the_origin_lacks_are_both_left_out_in_bounded_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = [_gone("pin/gone-a.cubin"), _gone("pin/gone-b.cubin")]
    # One run, then one more per entry left out: the same runs on every rank.
    assert _runs_leaving_out(tmp_path, caplog, monkeypatch, gone) == [1 + len(gone)] * 2


def test_many_recorded_entries_the_origin_lacks_take_a_bounded_number_of_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import distcache._resolve as resolve

    gone = [_gone(f"pin/gone-{i}.cubin") for i in range(9)]
    # One run per entry left out up to resolve._ONE_BY_ONE, then one without every
    # recorded entry no pool holds: not one run per missing entry.
    assert (_runs_leaving_out(tmp_path, caplog, monkeypatch, gone)
            == [resolve._ONE_BY_ONE + 1] * 2)
