"""``DISTCACHE_DISABLE=1`` turns Triton's cache manager into Triton's own file cache:
with ``TRITON_CACHE_MANAGER`` naming distcache's manager (exported, or inherited from
a process that set it), no pool is made, nothing is published and a miss is not
filled from the pool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.runtime.cache")

REPO = Path(__file__).resolve().parents[2]
MANAGER = "distcache.jit._triton:PoolCacheManager"

# Put a kernel's group when the cache lacks it; report what the manager found.
_KERNEL = """
import json
from triton.runtime.cache import get_cache_manager
m = get_cache_manager("ab" * 32)
found = m.get_group("k.json")
if found is None:
    p = m.put(b"cubin of the kernel" * 40, "k.cubin")
    m.put_group("k.json", {"k.cubin": p})
print(json.dumps({"manager": type(m).__name__, "found": found is not None}))
"""


def run_kernel(tmp: Path, **extra: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTCACHE_", "TRITON_"))}
    env.update(TRITON_CACHE_MANAGER=MANAGER, TRITON_CACHE_DIR=str(tmp / "triton"),
               DISTCACHE_POOL=str(tmp / "pool"), PYTHONPATH=str(REPO),
               PYTHONWARNINGS="ignore", **extra)
    done = subprocess.run([sys.executable, "-c", _KERNEL], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_disabled_manager_is_tritons_own_file_cache(tmp_path: Path) -> None:
    first = run_kernel(tmp_path, DISTCACHE_DISABLE="1")
    assert first == {"manager": "PoolCacheManager", "found": False}
    assert not (tmp_path / "pool").exists()  # no pool made, nothing published
    # Its own directory still serves it, as Triton's manager does.
    assert run_kernel(tmp_path, DISTCACHE_DISABLE="1")["found"] is True
    shutil.rmtree(tmp_path / "triton")
    assert run_kernel(tmp_path, DISTCACHE_DISABLE="1")["found"] is False
    assert not (tmp_path / "pool").exists()


def test_a_disabled_manager_is_not_filled_from_a_pool_that_holds_the_kernel(
        tmp_path: Path) -> None:
    assert run_kernel(tmp_path)["found"] is False  # enabled: published to the pool
    assert (tmp_path / "pool").is_dir()
    shutil.rmtree(tmp_path / "triton")
    assert run_kernel(tmp_path, DISTCACHE_DISABLE="1")["found"] is False
    shutil.rmtree(tmp_path / "triton")
    assert run_kernel(tmp_path)["found"] is True  # enabled again: filled from the pool
