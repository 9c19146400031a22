"""The engine hooks set the families' variables as ``init`` does: under
``DISTCACHE_JIT_CACHES=triton`` the start-up hook (``DISTCACHE_AUTOINSTALL=1``) and the
vLLM plugin give the engine process, and so every process it starts,
``TRITON_CACHE_MANAGER`` and ``DISTCACHE_POOL``, where they are unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MANAGER = "distcache.jit._triton:PoolCacheManager"
WANTED = ("TRITON_CACHE_MANAGER", "DISTCACHE_POOL")

# The engine: its variables, and those of a process it starts.
_ENGINE = """
import json, os, subprocess, sys
if sys.argv[1] == "plugin":
    from distcache.integrations.vllm import register
    register()
names = NAMES
child = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps("
                        "{n: os.environ.get(n) for n in NAMES}))"],
                       capture_output=True, text=True, timeout=120, check=True)
print(json.dumps({"engine": {n: os.environ.get(n) for n in names},
                  "child": json.loads(child.stdout)}))
""".replace("NAMES", repr(WANTED))


def run_engine(tmp: Path, how: str, **extra: str) -> dict[str, dict[str, str | None]]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTCACHE_", "TRITON_", "VLLM_"))}
    env.update(DISTCACHE_JIT_CACHES="triton", TRITON_CACHE_DIR=str(tmp / "triton"),
               HOME=str(tmp), XDG_CACHE_HOME=str(tmp / "cache"), PYTHONPATH=str(REPO),
               PYTHONWARNINGS="ignore", **extra)
    if how == "hook":
        env["DISTCACHE_AUTOINSTALL"] = "1"
    done = subprocess.run([sys.executable, "-c", _ENGINE, how], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, str | None]] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("how", ["hook", "plugin"])
def test_the_engine_and_its_children_get_the_triton_manager_and_the_pool(
        tmp_path: Path, how: str) -> None:
    pool = str(tmp_path / "pool")
    found = run_engine(tmp_path, how, DISTCACHE_POOL=pool)
    assert found["engine"] == found["child"] == {"TRITON_CACHE_MANAGER": MANAGER,
                                                 "DISTCACHE_POOL": pool}
    # Without DISTCACHE_POOL: the pool the hook filled from, the default one.
    found = run_engine(tmp_path, how)
    assert found["engine"] == {"TRITON_CACHE_MANAGER": MANAGER,
                               "DISTCACHE_POOL": str(tmp_path / "cache" / "distcache")}


def test_a_manager_the_user_set_is_kept(tmp_path: Path) -> None:
    mine = "triton.runtime.cache:FileCacheManager"
    found = run_engine(tmp_path, "hook", TRITON_CACHE_MANAGER=mine)
    assert found["engine"]["TRITON_CACHE_MANAGER"] == mine


def test_disabled_hooks_set_nothing(tmp_path: Path) -> None:
    found = run_engine(tmp_path, "plugin", DISTCACHE_DISABLE="1")
    assert found["engine"] == {"TRITON_CACHE_MANAGER": None, "DISTCACHE_POOL": None}
