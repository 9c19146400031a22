"""A site's first day at world size 1: a warm pool starts without an origin, and
``DISTCACHE_OFFLINE=1`` makes no request from ``init``, ``distcache fetch`` or
``distcache prefetch``, however the origin is configured. A miss is one error naming
what is missing and the command that fetches it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcache
from distcache.artifact import Artifact, manifest_text
from distcache.errors import ConfigError
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin
from tests.support.helpers import isolated_init, on_threads

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


@pytest.fixture
def manifest(tmp_path: Path, artifacts: list[Artifact]) -> Path:
    path = tmp_path / "checksums.txt"
    path.write_text(manifest_text(artifacts))
    return path


def _fill(pool: Path, artifact_dir: Path, artifacts: list[Artifact]) -> ArtifactPool:
    store = ArtifactPool(pool)
    for a in artifacts:
        store.put((artifact_dir / a.name).read_bytes(), a.sha256)
    return store


def _cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    clean.update({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(REPO), **env})
    return subprocess.run([sys.executable, "-m", "distcache", *args], capture_output=True,
                          text=True, env=clean, timeout=120, start_new_session=True, check=False)


# -- a warm pool needs no origin -------------------------------------------------------


def test_init_on_a_warm_pool_without_an_origin_serves_the_pool(
    tmp_path: Path, artifact_dir: Path, artifacts: list[Artifact], manifest: Path
) -> None:
    _fill(tmp_path / "pool", artifact_dir, artifacts)
    with distcache.init(pool=tmp_path / "pool", manifests=[manifest], integrations=()) as s:
        assert s.report is not None
        assert s.report.downloads == 0 and s.report.pool_hits == len(artifacts)


def test_prefetch_command_on_a_warm_pool_without_an_origin_succeeds(
    tmp_path: Path, artifact_dir: Path, artifacts: list[Artifact], manifest: Path
) -> None:
    _fill(tmp_path / "pool", artifact_dir, artifacts)
    done = _cli(tmp_path, "--pool", str(tmp_path / "pool"), "prefetch", "--manifest",
                str(manifest))
    assert done.returncode == 0, done.stderr
    assert f"{len(artifacts)} already everywhere" in done.stdout, done
    assert "; 0 downloads" in done.stdout, done


def test_what_no_pool_holds_is_one_error_naming_it_and_the_command_that_fetches_it(
    tmp_path: Path, artifact_dir: Path, artifacts: list[Artifact], manifest: Path
) -> None:
    _fill(tmp_path / "pool", artifact_dir, artifacts[:1])
    with pytest.raises(ConfigError) as caught:
        distcache.init(pool=tmp_path / "pool", manifests=[manifest], integrations=())
    text = str(caught.value)
    missing = sorted(a.name for a in artifacts[1:])
    assert f"{len(missing)} artifact(s) are in no pool and no origin is set" in text
    assert all(name in text for name in missing[:5])
    assert f"and {len(missing) - 5} more" in text
    assert str(tmp_path / "pool") in text
    assert f"distcache fetch --manifest {manifest} --origin URL" in text
    assert "DISTCACHE_ORIGIN" in text and caught.value.variable == "DISTCACHE_ORIGIN"


# -- DISTCACHE_OFFLINE=1: no request from any path -------------------------------------


def test_offline_init_with_an_origin_makes_no_request_and_names_the_miss_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, artifact_dir: Path,
    artifacts: list[Artifact], manifest: Path, origin_server: LoopbackOrigin,
) -> None:
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    monkeypatch.setenv("DISTCACHE_ORIGIN", origin_server.url)
    _fill(tmp_path / "pool", artifact_dir, artifacts[:2])
    with pytest.raises(ConfigError, match="DISTCACHE_OFFLINE=1 forbids downloads") as caught:
        distcache.init(pool=tmp_path / "pool", manifests=[manifest], integrations=())
    assert f"{len(artifacts) - 2} artifact(s) are in no pool" in str(caught.value)
    assert "distcache pool import" in str(caught.value)
    assert origin_server.total_requests == 0
    # Once the pool holds everything the same start-up succeeds, still without a request.
    _fill(tmp_path / "pool", artifact_dir, artifacts)
    with distcache.init(pool=tmp_path / "pool", origin=origin_server.url,
                        manifests=[manifest], integrations=()) as session:
        assert session.report is not None and session.report.downloads == 0
    assert origin_server.total_requests == 0


def test_offline_collective_prefetch_with_an_origin_makes_no_request(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, artifacts: list[Artifact],
    origin_server: LoopbackOrigin,
) -> None:
    from distcache.collective import prefetch
    from distcache.comm import local
    from distcache.errors import PrefetchError
    from distcache.origins import open_origin

    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    with pytest.raises(PrefetchError, match="DISTCACHE_OFFLINE=1"):
        prefetch(artifacts, comm=local(), pool=ArtifactPool(tmp_path / "pool"),
                 origin=open_origin(origin_server.url), timeout=30)
    assert origin_server.total_requests == 0


def test_offline_fetch_and_prefetch_commands_make_no_request(
    tmp_path: Path, artifact_dir: Path, artifacts: list[Artifact], manifest: Path,
    origin_server: LoopbackOrigin,
) -> None:
    pool = str(tmp_path / "pool")
    _fill(tmp_path / "pool", artifact_dir, artifacts[:1])
    env = {"DISTCACHE_OFFLINE": "1", "DISTCACHE_ORIGIN": origin_server.url}
    for command in (["fetch", "--manifest", str(manifest), "--origin", origin_server.url],
                    ["prefetch", "--manifest", str(manifest), "--origin", origin_server.url]):
        done = _cli(tmp_path, "--pool", pool, *command, **env)
        assert done.returncode == 1, done
        # One error for the job (progress lines aside), not one per artifact.
        lines = [line for line in done.stderr.splitlines() if "no pool" in line]
        assert len(lines) == 1, done.stderr
        assert f"{len(artifacts) - 1} artifact(s) are in no pool" in lines[0]
        assert "DISTCACHE_OFFLINE=1" in lines[0]
        assert not any(a.name in done.stderr.replace(lines[0], "") for a in artifacts), done
    assert origin_server.total_requests == 0
    _fill(tmp_path / "pool", artifact_dir, artifacts)
    for command in (["fetch", "--manifest", str(manifest)],
                    ["prefetch", "--manifest", str(manifest)]):
        done = _cli(tmp_path, "--pool", pool, *command, **env)
        assert done.returncode == 0, done
    assert origin_server.total_requests == 0


# -- deadlines that tell absence from slowness -----------------------------------------

SLOW = 0.25  # seconds the origin takes per artifact
STEADY = 16  # artifacts: about 2 x the timeout below at one download at a time
TIMEOUT = 2.0


def _steady(tmp_path: Path) -> tuple[LoopbackOrigin, list[Artifact]]:
    from distcache.artifact import parse_checksums
    from distcache.testing import make_artifacts

    make_artifacts(tmp_path / "slow", STEADY, min_size=200, max_size=400, seed=5)
    listed = parse_checksums((tmp_path / "slow" / "checksums.txt").read_text())
    return LoopbackOrigin(tmp_path / "slow", latency=SLOW), listed


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_slow_steady_origin_finishes_although_the_fetch_outlasts_the_timeout(
    tmp_path: Path, ranks: int
) -> None:
    import time

    from distcache.collective import prefetch
    from distcache.comm import ThreadGroup
    from distcache.origins import open_origin

    server, listed = _steady(tmp_path)
    group = ThreadGroup(ranks, timeout=TIMEOUT)
    pools = [ArtifactPool(tmp_path / f"pool{r}") for r in range(ranks)]
    start = time.monotonic()
    with server:
        results = on_threads(ranks, lambda r: prefetch(
            listed, comm=group.comm(r), pool=pools[r], origin=open_origin(server.url),
            timeout=TIMEOUT, downloads_per_rank=1, downloads_per_job=1))
        requests = server.total_requests
    elapsed = time.monotonic() - start
    for result in results:
        assert not isinstance(result, BaseException), result
        assert result.downloads == STEADY
    assert requests == STEADY
    # One download at a time: the phase outlasted the timeout and still finished.
    assert elapsed > TIMEOUT
    for pool in pools:
        assert sorted(pool.objects()) == sorted(a.sha256 for a in listed)


class _Silent:
    """A rank's communicator that stops answering once ``when()`` holds (a process
    stopped or stuck mid-collective), until ``release`` is set."""

    def __init__(self, inner: Any, when: Any) -> None:
        import threading

        self.inner, self.when = inner, when
        self.release = threading.Event()
        self.silent_since: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> Any:
        import time

        if self.when():
            self.silent_since = self.silent_since or time.monotonic()
            self.release.wait(60)
        return self.inner.allgather_object(obj, timeout=timeout)


def test_a_peer_silent_in_the_fetch_fails_the_others_within_the_timeout_despite_progress(
    tmp_path: Path,
) -> None:
    import time

    from distcache.collective import prefetch
    from distcache.comm import ThreadGroup
    from distcache.errors import CollectiveTimeout, PrefetchError
    from distcache.origins import open_origin

    server, listed = _steady(tmp_path)
    group = ThreadGroup(2, timeout=TIMEOUT)
    pools = [ArtifactPool(tmp_path / f"pool{r}") for r in range(2)]
    failed_at: list[float] = [0.0, 0.0]
    with server:
        silent = _Silent(group.comm(1), lambda: server.total_requests > 0)

        def body(rank: int) -> Any:
            comm = group.comm(0) if rank == 0 else silent
            try:
                # Rank 0 downloads everything, slowly: its own progress never stalls.
                return prefetch(listed, comm=comm, pool=pools[rank], origin=open_origin(
                    server.url), timeout=TIMEOUT, downloads_per_rank=1, downloads_per_job=1)
            finally:
                failed_at[rank] = time.monotonic()
                if rank == 0:
                    silent.release.set()

        results = on_threads(2, body)
        requests = server.total_requests
    assert isinstance(results[0], PrefetchError), results[0]
    assert isinstance(results[0].__cause__, CollectiveTimeout)
    assert silent.silent_since is not None
    # Within the timeout of the silence, plus one heartbeat and a loaded machine's slack.
    assert failed_at[0] - silent.silent_since < TIMEOUT + 3.0
    assert requests < STEADY  # it failed while the origin was still delivering
    assert isinstance(results[1], PrefetchError), results[1]


def test_ranks_that_disagree_on_having_an_origin_fetch_nothing_and_fail_alike(
    tmp_path: Path, artifact_dir: Path, artifacts: list[Artifact], manifest: Path,
    origin_server: LoopbackOrigin,
) -> None:
    from distcache._resolve import prefetch_manifests
    from distcache.comm import ThreadGroup
    from distcache.origins import open_origin

    group = ThreadGroup(2, timeout=20)
    pools = [_fill(tmp_path / "warm", artifact_dir, artifacts), ArtifactPool(tmp_path / "cold")]
    origins = [None, open_origin(origin_server.url)]  # only rank 1 has one
    reports = on_threads(2, lambda r: prefetch_manifests(
        group.comm(r), pools[r], origins[r], manifests=[manifest], timeout=20, offline=False))
    for report in reports:
        assert not isinstance(report, BaseException), report
        assert report.downloads == 0
    assert all(pools[1].has(a.sha256) for a in artifacts)  # moved from rank 0's pool
    absent = Artifact("cubins/absent/none.cubin", "0" * 64)
    errors = on_threads(2, lambda r: prefetch_manifests(
        group.comm(r), pools[r], origins[r], manifests=[[*artifacts, absent]], timeout=20,
        offline=False))
    assert all(isinstance(e, ConfigError) for e in errors), errors
    assert str(errors[0]) == str(errors[1]) and absent.name in str(errors[0])
    assert origin_server.total_requests == 0


# -- the move phase: ranks outside the move wait while it makes progress -------------


def _move_setup(tmp_path: Path, put: Any) -> tuple[list[Artifact], list[ArtifactPool]]:
    """Three ranks: rank 0's pool holds every artifact; ranks 1 and 2 share one empty
    pool, whose writer is rank 1 (rank 2 takes no part in the move). Rank 1's pool
    publishes through ``put``."""
    from distcache.artifact import parse_checksums
    from distcache.testing import make_artifacts

    make_artifacts(tmp_path / "src", STEADY, min_size=200, max_size=400, seed=6)
    listed = parse_checksums((tmp_path / "src" / "checksums.txt").read_text())
    warm = ArtifactPool(tmp_path / "warm")
    for artifact in listed:
        warm.put((tmp_path / "src" / artifact.name).read_bytes(), artifact.sha256)
    warm.remember(listed)
    receiving = ArtifactPool(tmp_path / "cold")
    inner = receiving.put
    receiving.put = lambda data, sha256=None: put(inner, data, sha256)  # type: ignore[method-assign]
    return listed, [warm, receiving, ArtifactPool(tmp_path / "cold")]


def test_a_slow_steady_move_finishes_for_a_rank_outside_it_past_the_timeout(
    tmp_path: Path,
) -> None:
    import time

    from distcache.collective import prefetch
    from distcache.comm import ThreadGroup

    def slow(inner: Any, data: Any, sha256: str | None) -> str:
        time.sleep(SLOW)
        return inner(data, sha256)

    listed, pools = _move_setup(tmp_path, slow)
    group = ThreadGroup(3, timeout=TIMEOUT)
    start = time.monotonic()
    # One artifact per bucket: the move takes STEADY x SLOW, about twice the timeout.
    results = on_threads(3, lambda r: prefetch(
        listed, comm=group.comm(r), pool=pools[r], origin=None, timeout=TIMEOUT,
        bucket_bytes=1))
    elapsed = time.monotonic() - start
    for result in results:
        assert not isinstance(result, BaseException), result
        assert result.downloads == 0 and result.objects_published == STEADY
    assert result.writers == (0, 1)
    assert elapsed > TIMEOUT
    assert sorted(pools[2].objects()) == sorted(a.sha256 for a in listed)


def test_a_writer_stuck_in_the_move_fails_every_rank_within_the_timeout(
    tmp_path: Path,
) -> None:
    import threading
    import time

    from distcache.collective import prefetch
    from distcache.comm import ThreadGroup
    from distcache.errors import PrefetchError

    release = threading.Event()
    stuck_since: list[float] = []

    def stuck(inner: Any, data: Any, sha256: str | None) -> str:
        # The first publication hangs, as on a dead disk or a hung NFS server.
        if not stuck_since:
            stuck_since.append(time.monotonic())
            release.wait(60)
        return inner(data, sha256)

    listed, pools = _move_setup(tmp_path, stuck)
    group = ThreadGroup(3, timeout=TIMEOUT)
    failed_at = [0.0] * 3

    def body(rank: int) -> Any:
        try:
            return prefetch(listed, comm=group.comm(rank), pool=pools[rank],
                            origin=None, timeout=TIMEOUT, bucket_bytes=1)
        finally:
            failed_at[rank] = time.monotonic()

    try:
        results = on_threads(3, body)
    finally:
        release.set()
    assert stuck_since
    messages = set()
    for rank, result in enumerate(results):
        assert isinstance(result, PrefetchError), result
        assert result.phase == "move"
        messages.add(str(result))
        # Within the timeout of the stall, plus a heartbeat and a loaded machine's slack.
        assert failed_at[rank] - stuck_since[0] < 2 * TIMEOUT + 3.0
    assert len(messages) == 1, "the same error on every rank"
    assert "made no progress" in messages.pop()


@pytest.mark.parametrize(("backend", "level", "together"), [
    ("gloo", 0, True), ("mpi", 3, True), ("mpi", 2, False), ("mpi+torch", 2, False),
    ("mpi+torch", 3, True)])
def test_the_move_runs_beside_the_heartbeats_only_where_the_transport_allows_two_threads(
    monkeypatch: pytest.MonkeyPatch, backend: str, level: int, together: bool
) -> None:
    import types

    from distcache.collective._heartbeat import concurrent

    fake = types.SimpleNamespace(Query_thread=lambda: level, THREAD_MULTIPLE=3)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    assert concurrent(types.SimpleNamespace(backend=backend)) is together  # type: ignore[arg-type]
