"""A directory option written ``--pool=~/x``: a shell expands ``~`` at the start of a
word, never after ``--pool=``, so the command is handed ``~/x`` and would make a
directory named ``~`` wherever it runs. ``distcache`` and ``python -m launch`` refuse
such a value (exit 2) and make nothing; a ``~`` further on is a name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distcache.testing import make_artifacts
from tests.support.cli import cli_env
from tests.support.process import run_group

PY = sys.executable
_LAUNCHER = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "PRTE_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No ``DISTCACHE_*`` settings and no launcher: each command runs alone."""
    return {k: v for k, v in cli_env(tmp_path).items()
            if not k.startswith(_LAUNCHER) and k not in _LAUNCHER_NAMES}


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_group(cmd, timeout=120, env=env, cwd=cwd)


def _served(tmp_path: Path) -> Path:
    served = tmp_path / "origin"
    make_artifacts(served, 2, min_size=100, max_size=200, seed=5)
    return served


@pytest.mark.parametrize("value", ["~/x", "~", "~alice/pool"])
def test_distcache_refuses_a_pool_that_starts_with_a_tilde(
    tmp_path: Path, env: dict[str, str], value: str
) -> None:
    served = _served(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = _run([PY, "-m", "distcache", f"--pool={value}", "fetch", "--manifest",
                 str(served / "checksums.txt"), "--origin", str(served)], env, cwd)
    assert done.returncode == 2, (done.stdout, done.stderr)
    last = done.stderr.strip().splitlines()[-1]  # argparse's usage line, then the error
    assert last.startswith("distcache: error: argument --pool: "), done.stderr
    assert f"{value!r} starts with '~'" in last, last
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("option", ["--pool", "--workspace"])
def test_launch_refuses_a_directory_option_that_starts_with_a_tilde(
    tmp_path: Path, env: dict[str, str], option: str
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = _run([PY, "-m", "launch", f"{option}=~/x", "--", "true"], env, cwd)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("python -m launch: error: "), lines[0]
    assert f"argument {option}" in lines[0] and "starts with '~'" in lines[0], lines[0]
    assert list(cwd.iterdir()) == []


def test_a_tilde_further_on_is_part_of_the_name(tmp_path: Path, env: dict[str, str]) -> None:
    served = _served(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = _run([PY, "-m", "distcache", "--pool=./a~b", "fetch", "--manifest",
                 str(served / "checksums.txt"), "--origin", str(served)], env, cwd)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert (cwd / "a~b" / "objects").is_dir()
