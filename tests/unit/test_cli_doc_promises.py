"""What docs/cli.md and docs/launchers.md promise, through the real commands: the
launch wrapper dies of the signal that killed its program (SIGKILL too: an OOM kill
must reach mpirun as one), ``fetch`` under a size cap keeps the whole set as prefetch
and import do, and a malformed ``--arch`` or an unknown ``--family`` is bad usage
(exit 2) refused before any pool is made."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.cli import cli_env, run_cli
from tests.support.process import run_group

_LAUNCHER = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
          "GROUP_RANK")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No ``DISTCACHE_*`` settings, and no launcher: the wrapper runs alone."""
    return {k: v for k, v in cli_env(tmp_path).items()
            if not k.startswith(_LAUNCHER) and k not in _NAMES}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_wrapper_dies_of_the_signal_that_killed_its_program(
    tmp_path: Path, env: dict[str, str], sig: signal.Signals
) -> None:
    done = run_group([sys.executable, "-m", "launch", "--pool", str(tmp_path / "pool"), "--",
                      "sh", "-c", f"kill -{sig.name[3:]} $$"], timeout=120, env=env)
    assert done.returncode == -sig, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("held_before", [0, 1])
def test_fetch_under_a_size_cap_keeps_the_whole_set_with_a_warning(
    tmp_path: Path, env: dict[str, str], held_before: int
) -> None:
    served = tmp_path / "origin"
    artifacts = make_artifacts(served, 3, min_size=1_000, max_size=1_200, seed=3)
    pool = tmp_path / "pool"
    for artifact in artifacts[:held_before]:  # found in the pool: part of the set too
        ArtifactPool(pool).put((served / artifact.name).read_bytes())
    env = {**env, "DISTCACHE_POOL_MAX_BYTES": "1500"}
    done = run_cli(env, "--pool", str(pool), "fetch", "--manifest",
                   str(served / "checksums.txt"), "--origin", str(served))
    assert done.returncode == 0, done.stderr
    held = ArtifactPool(pool)
    assert all(held.has(a.sha256) for a in artifacts)  # the set, over the cap, kept whole
    assert "more than its cap" in done.stderr, done.stderr


@pytest.mark.parametrize(("options", "said"), [
    (["--family", "TRTLLM_GEN_FMHA", "--arch", "foo"], "bad GPU architecture 'foo'"),
    (["--family", "NO_SUCH_FAMILY"], "unknown FlashInfer artifact family 'NO_SUCH_FAMILY'"),
    (["--family", "TRTLLM_GEN_FMHA", "--arch", "foo", "--dry-run"],
     "bad GPU architecture 'foo'"),
])
def test_a_malformed_arch_or_unknown_family_is_refused_before_a_pool_is_made(
    tmp_path: Path, env: dict[str, str], options: list[str], said: str
) -> None:
    pytest.importorskip("flashinfer")  # the families are the installed FlashInfer's pins
    pool = tmp_path / "pool"
    done = run_cli(env, "--pool", str(pool), "prefetch", "--flashinfer", *options)
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not pool.exists()
