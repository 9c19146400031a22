"""Offline mode, FlashInfer's own errors, a final "not found", where materialised files
go, the loader's event, and a command line that works without torch."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import Artifact, manifest_text, sha256_hex
from distcache.integrations import flashinfer as fi
from distcache.integrations.flashinfer import _upstream
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts


@pytest.fixture(scope="module")
def loader_module() -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as module
    return module


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
          loader_module: object) -> Iterator[dict[str, object]]:
    artifacts = make_artifacts(tmp_path / "origin", 3, min_size=500, max_size=900)
    pool = ArtifactPool(tmp_path / "pool")
    pool.put((tmp_path / "origin" / artifacts[0].name).read_bytes(), artifacts[0].sha256)
    cubins = tmp_path / "cubins"
    for var in ("DISTCACHE_ORIGIN", "DISTCACHE_OFFLINE", "FLASHINFER_NO_DOWNLOAD",
                "DISTCACHE_DISABLE", "DISTCACHE_FLASHINFER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", cubins)
    with LoopbackOrigin(tmp_path / "origin") as origin:
        monkeypatch.setattr(loader_module, "FLASHINFER_CUBINS_REPOSITORY", origin.url)
        try:
            yield {"artifacts": artifacts, "pool": pool, "origin": origin, "cubins": cubins}
        finally:
            fi.uninstall()


def test_offline_serves_the_pool_and_refuses_a_miss_with_flashinfers_error(
    world: dict[str, object], loader_module: object, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    artifacts: list[Artifact] = world["artifacts"]  # type: ignore[assignment]
    fi.install(world["pool"])  # type: ignore[arg-type]
    import os

    assert os.environ["FLASHINFER_NO_DOWNLOAD"] == "1"
    get = loader_module.get_artifact  # type: ignore[attr-defined]
    assert get(artifacts[0].name, artifacts[0].sha256)
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as raised:
        get(artifacts[1].name, artifacts[1].sha256)
    # FlashInfer's own message, unchanged.
    assert str(raised.value).startswith(f"Artifact not found locally: {artifacts[1].name}")
    line = next(r.getMessage() for r in caplog.records if "DISTCACHE_OFFLINE" in r.getMessage())
    assert artifacts[1].name in line and artifacts[1].sha256 in line
    assert "distcache fetch --manifest" in line and "distcache pool import" in line
    assert world["origin"].total_requests == 0  # type: ignore[attr-defined]
    fi.uninstall()
    assert "FLASHINFER_NO_DOWNLOAD" not in os.environ


def test_not_found_at_flashinfers_repository_is_final(
    world: dict[str, object], loader_module: object, caplog: pytest.LogCaptureFixture,
) -> None:
    loader = fi.install(world["pool"])  # type: ignore[arg-type]
    assert loader is not None
    ghost = Artifact("cubins/0123456789abcdef0123456789abcdef01234567/fmha/ghost.cubin",
                     "ab" * 32)
    with caplog.at_level(logging.ERROR):
        answer = loader_module.get_artifact(ghost.name, ghost.sha256)  # type: ignore[attr-defined]
    assert answer == b""
    assert loader.stats.not_found == 1
    # One request: FlashInfer's retrying download of the same URL was not tried.
    assert world["origin"].requests[ghost.name] == 1  # type: ignore[attr-defined]
    assert any("not tried" in r.getMessage() for r in caplog.records)


def test_an_installed_cubin_dir_is_read_never_written(
    world: dict[str, object], loader_module: object, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    artifacts: list[Artifact] = world["artifacts"]  # type: ignore[assignment]
    installed = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "flashinfer_cubin"
    cubins = installed / "cubins"
    data = b"// header\n"
    header = Artifact("cubins/" + "c" * 40 + "/gemm/include/meta.h", sha256_hex(data))
    seeded = cubins / artifacts[2].name
    seeded.parent.mkdir(parents=True)
    seeded.write_bytes((tmp_path / "origin" / artifacts[2].name).read_bytes())
    world["pool"].put(data, header.sha256)  # type: ignore[attr-defined]
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", cubins)
    env_module = sys.modules["flashinfer.jit.env"]
    monkeypatch.setattr(env_module, "FLASHINFER_CUBIN_DIR", cubins)
    monkeypatch.setattr(env_module, "FLASHINFER_CACHE_DIR", tmp_path / "cache")
    before = sorted(p for p in installed.rglob("*"))
    fi.install(world["pool"])  # type: ignore[arg-type]
    writable = tmp_path / "cache" / "cubins"
    assert writable == loader_module.FLASHINFER_CUBIN_DIR  # type: ignore[attr-defined]
    assert writable == env_module.FLASHINFER_CUBIN_DIR  # type: ignore[attr-defined]
    get = loader_module.get_artifact  # type: ignore[attr-defined]
    # The installed file is served (and pooled) without a request.
    assert get(artifacts[2].name, artifacts[2].sha256) == seeded.read_bytes()
    assert world["pool"].has(artifacts[2].sha256)  # type: ignore[attr-defined]
    # A header is materialised into the writable cache, not into site-packages.
    assert get(header.name, header.sha256) == data
    assert (writable / header.name).read_bytes() == data
    assert sorted(p for p in installed.rglob("*")) == before
    assert world["origin"].total_requests == 0  # type: ignore[attr-defined]
    fi.uninstall()
    assert cubins == loader_module.FLASHINFER_CUBIN_DIR  # type: ignore[attr-defined]


def test_installed_location_is_recognised(tmp_path: Path) -> None:
    assert _upstream.is_installed_location(tmp_path / "x" / "site-packages" / "flashinfer_cubin")
    import sysconfig

    assert _upstream.is_installed_location(Path(sysconfig.get_path("purelib")) / "pkg")
    assert _upstream.is_installed_location(tmp_path / "usr" / "lib" / "dist-packages")
    assert not _upstream.is_installed_location(tmp_path / "cache")


def test_loader_statistics_go_to_the_event_log(
    world: dict[str, object], loader_module: object, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(events))
    artifacts: list[Artifact] = world["artifacts"]  # type: ignore[assignment]
    fi.install(world["pool"])  # type: ignore[arg-type]
    loader_module.get_artifact(artifacts[0].name, artifacts[0].sha256)  # type: ignore[attr-defined]
    fi.uninstall()
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    stats = [e for e in lines if e["event"] == "flashinfer.loader"]
    assert len(stats) == 1 and stats[0]["hits"] == 1 and stats[0]["fetched"] == 0


def test_pool_commands_never_import_torch(tmp_path: Path) -> None:
    artifacts = make_artifacts(tmp_path / "set", 2, min_size=100, max_size=200)
    (tmp_path / "m.txt").write_text(manifest_text(artifacts))
    code = (
        "import sys\n"
        "from distcache.cli import main\n"
        "codes = [main(a) for a in sys.argv[1:2] and [\n"
        f"  ['fetch', '--pool', {str(tmp_path / 'pool')!r}, '--manifest', "
        f"{str(tmp_path / 'm.txt')!r}, '--origin', {str(tmp_path / 'set')!r}],\n"
        f"  ['pool', '--pool', {str(tmp_path / 'pool')!r}, 'stats'],\n"
        f"  ['pool', '--pool', {str(tmp_path / 'pool')!r}, 'ls'],\n"
        f"  ['pool', '--pool', {str(tmp_path / 'pool')!r}, 'verify'],\n"
        f"  ['pool', '--pool', {str(tmp_path / 'pool2')!r}, 'import', {str(tmp_path / 'set')!r}],\n"
        f"  ['pool', '--pool', {str(tmp_path / 'pool2')!r}, 'export', '--tar', "
        f"{str(tmp_path / 'set.tar')!r}],\n"
        "]]\n"
        "print(codes, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'mpi4py', 'flashinfer')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, "go"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0, 0, 0] []"
    assert (tmp_path / "set.tar").stat().st_size > 0


@pytest.mark.parametrize("same", [True, False])
def test_not_found_is_final_only_at_flashinfers_own_repository(
    world: dict[str, object], loader_module: object, tmp_path: Path, same: bool,
) -> None:
    from distcache.origins import open_origin

    url = world["origin"].url  # type: ignore[attr-defined]
    other = tmp_path / "other-origin"
    other.mkdir()
    loader = fi.install(world["pool"], open_origin(url if same else str(other)))  # type: ignore[arg-type]
    assert loader is not None and loader.final_not_found is same


def test_a_download_the_pool_cannot_publish_is_served_once_and_flashinfer_is_not_asked(
    world: dict[str, object], loader_module: object, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import errno
    import os

    artifacts: list[Artifact] = world["artifacts"]  # type: ignore[assignment]
    origin: LoopbackOrigin = world["origin"]  # type: ignore[assignment]
    real_link = os.link

    def objects_not_writable(src: str, dst: str, *args: object, **kwargs: object) -> None:
        if f"{os.sep}objects{os.sep}" in os.fspath(dst):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(dst))
        real_link(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "link", objects_not_writable)
    loader = fi.install(world["pool"])  # type: ignore[arg-type]
    assert loader is not None
    get = loader_module.get_artifact  # type: ignore[attr-defined]
    root = world["pool"].root  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING):
        for artifact in artifacts[1:]:
            data = get(artifact.name, artifact.sha256)
            assert sha256_hex(data) == artifact.sha256
    # One request each: FlashInfer's own download (the same origin) was not asked.
    assert origin.total_requests == len(artifacts) - 1
    assert (loader.stats.fallbacks, loader.stats.unpublished) == (0, len(artifacts) - 1)
    logged = [r.getMessage() for r in caplog.records if "cannot take downloads" in r.getMessage()]
    assert len(logged) == 1 and str(root) in logged[0], logged
    assert not any(world["pool"].has(a.sha256) for a in artifacts[1:])  # type: ignore[attr-defined]
