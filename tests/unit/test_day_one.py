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

import pytest

import distcache
from distcache.artifact import Artifact, manifest_text
from distcache.errors import ConfigError
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    for var in [v for v in os.environ if v.startswith("DISTCACHE_")]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    yield
    current = distcache.session.current()
    if current is not None:
        current.close()


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
    with distcache.init(pool=tmp_path / "pool", manifests=[manifest], flashinfer=False) as s:
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
        distcache.init(pool=tmp_path / "pool", manifests=[manifest], flashinfer=False)
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
        distcache.init(pool=tmp_path / "pool", manifests=[manifest], flashinfer=False)
    assert f"{len(artifacts) - 2} artifact(s) are in no pool" in str(caught.value)
    assert "distcache pool import" in str(caught.value)
    assert origin_server.total_requests == 0
    # Once the pool holds everything the same start-up succeeds, still without a request.
    _fill(tmp_path / "pool", artifact_dir, artifacts)
    with distcache.init(pool=tmp_path / "pool", origin=origin_server.url,
                        manifests=[manifest], flashinfer=False) as session:
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
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert f"{len(artifacts) - 1} artifact(s) are in no pool" in lines[0]
        assert "DISTCACHE_OFFLINE=1" in lines[0]
    assert origin_server.total_requests == 0
    _fill(tmp_path / "pool", artifact_dir, artifacts)
    for command in (["fetch", "--manifest", str(manifest)],
                    ["prefetch", "--manifest", str(manifest)]):
        done = _cli(tmp_path, "--pool", pool, *command, **env)
        assert done.returncode == 0, done
    assert origin_server.total_requests == 0
