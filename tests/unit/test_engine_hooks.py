"""Engines that start their own processes: the vLLM general plugin and the opt-in
start-up hook install the FlashInfer wrapper in processes whose code never calls
distcache; lookups then hit the pool and the origin sees no request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import manifest_text
from distcache.integrations import _autoinstall
from distcache.integrations.flashinfer._upstream import LOADER_MODULE
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.process import run_group

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "engine_worker.py"


@pytest.fixture
def seeded(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """An origin with 4 artifacts, a pool holding 3 of them, and their checksums."""
    artifacts = make_artifacts(tmp_path / "origin", 4, min_size=1000, max_size=4000)
    pool = ArtifactPool(tmp_path / "pool")
    for artifact in artifacts[:3]:
        pool.put((tmp_path / "origin" / artifact.name).read_bytes(), artifact.sha256)
    pooled = tmp_path / "pooled.txt"
    pooled.write_text(manifest_text(artifacts[:3]))
    missing = tmp_path / "missing.txt"
    missing.write_text(manifest_text(artifacts[3:]))
    with LoopbackOrigin(tmp_path / "origin") as origin:
        yield {"origin": origin, "pool": tmp_path / "pool", "pooled": pooled,
               "missing": missing, "artifacts": artifacts, "tmp": tmp_path}


def engine_env(seeded: dict[str, Any], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTCACHE_", "FLASHINFER_", "VLLM_"))}
    env.update(
        DISTCACHE_POOL=str(seeded["pool"]),
        FLASHINFER_CUBINS_REPOSITORY=seeded["origin"].url,
        FLASHINFER_CUBIN_DIR=str(seeded["tmp"] / "cubins"),
        PYTHONWARNINGS="ignore",
        **extra,
    )
    return env


def run_worker(seeded: dict[str, Any], mode: str, checksums: Path, **extra: str) -> dict[str, Any]:
    done = run_group([sys.executable, WORKER, mode, checksums], timeout=240,
                     env=engine_env(seeded, **extra), cwd=seeded["tmp"])
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def test_vllm_entry_point_is_declared_in_the_installed_distribution() -> None:
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("distcache") == "distcache.integrations.vllm:register"


def test_vllm_plugin_serves_flashinfer_from_the_pool_with_no_origin_request(
    seeded: dict[str, Any],
) -> None:
    result = run_worker(seeded, "vllm", seeded["pooled"])
    assert result["plugins"] == ["distcache"]
    assert result["loader"] == "PooledLoader"
    assert result["all_matched"] and result["count"] == 3
    assert result["stats"]["hits"] == 3 and result["stats"]["fetched"] == 0
    assert seeded["origin"].total_requests == 0


def test_vllm_plugin_fetches_a_miss_once_through_the_pool(seeded: dict[str, Any]) -> None:
    result = run_worker(seeded, "vllm", seeded["missing"])
    assert result["all_matched"] and result["stats"]["fetched"] == 1
    assert seeded["origin"].total_requests == 1
    assert ArtifactPool(seeded["pool"]).has(seeded["artifacts"][3].sha256)


@pytest.mark.parametrize("switch", [{"DISTCACHE_DISABLE": "1"}, {"VLLM_PLUGINS": "other"}])
def test_vllm_plugin_does_nothing_when_disabled_or_filtered_out(
    seeded: dict[str, Any], switch: dict[str, str]
) -> None:
    result = run_worker(seeded, "vllm", seeded["pooled"], **switch)
    assert result["loader"] == "function"
    assert result["all_matched"]
    # FlashInfer's own loader downloaded every artifact itself.
    assert seeded["origin"].total_requests == 3


def test_register_is_idempotent_and_non_collective(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader  # noqa: F401

    from distcache.integrations import flashinfer as fi
    from distcache.integrations.vllm import register

    monkeypatch.setenv("DISTCACHE_POOL", str(tmp_path / "pool"))
    try:
        register()
        first = fi.installed()
        register()
        assert first is not None and fi.installed() is first
    finally:
        fi.uninstall()


def test_arm_never_raises_on_a_bad_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCACHE_DISABLE", "maybe")
    assert _autoinstall.arm("test") is False


def test_loader_module_name_matches_the_integration() -> None:
    assert _autoinstall.LOADER_MODULE == LOADER_MODULE


def interpreter_modules(env: dict[str, str]) -> dict[str, bool]:
    code = ("import sys, json; print(json.dumps({m: m in sys.modules for m in "
            "('distcache', 'flashinfer', 'torch', 'distcache.integrations._startup')}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stderr == ""
    result: dict[str, bool] = json.loads(done.stdout)
    return result


def test_startup_hook_is_inert_unless_enabled(seeded: dict[str, Any]) -> None:
    off = interpreter_modules(engine_env(seeded))
    assert off == {"distcache": False, "flashinfer": False, "torch": False,
                   "distcache.integrations._startup": False}
    on = interpreter_modules(engine_env(seeded, DISTCACHE_AUTOINSTALL="1"))
    # Armed, yet neither FlashInfer nor torch is imported at interpreter start.
    assert on == {"distcache": True, "flashinfer": False, "torch": False,
                  "distcache.integrations._startup": True}


def test_startup_hook_survives_a_bad_setting(seeded: dict[str, Any]) -> None:
    env = engine_env(seeded, DISTCACHE_AUTOINSTALL="1", DISTCACHE_POOL_MAX_BYTES="lots")
    done = subprocess.run([sys.executable, "-c", "print('alive')"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "alive\n"
    assert "DISTCACHE_AUTOINSTALL" in done.stderr or "DISTCACHE_POOL_MAX_BYTES" in done.stderr


def test_workers_spawned_by_torch_multiprocessing_hit_the_pool(seeded: dict[str, Any]) -> None:
    out = seeded["tmp"] / "out"
    out.mkdir()
    env = engine_env(seeded, DISTCACHE_AUTOINSTALL="1", PYTHONPATH=str(REPO))
    done = run_group([sys.executable, "-m", "tests.support.spawn_parent", "2",
                      seeded["pooled"], out], timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]
    for result in results:
        assert result["loader"] == "PooledLoader"
        assert result["all_matched"] and result["stats"]["hits"] == 3
    assert seeded["origin"].total_requests == 0


def test_a_miss_is_fetched_once_per_pool_not_per_worker(seeded: dict[str, Any]) -> None:
    out = seeded["tmp"] / "out"
    out.mkdir()
    env = engine_env(seeded, DISTCACHE_AUTOINSTALL="1", PYTHONPATH=str(REPO))
    done = run_group([sys.executable, "-m", "tests.support.spawn_parent", "2",
                      seeded["missing"], out], timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert seeded["origin"].total_requests == 1




def test_user_agent_names_the_installed_distributions_version() -> None:
    from importlib import metadata

    from distcache.origins._http import _user_agent

    distribution = "distcache-kernels"
    assert _user_agent() == f"distcache/{metadata.version(distribution)}"
    assert metadata.distribution(distribution).entry_points.select(
        group="console_scripts", name="distcache")
