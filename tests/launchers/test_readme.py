"""Every snippet and command of the README runs as written.

The Python snippets run as programs and the shell commands as lines of `bash`, in a
scratch directory that holds what they name (``checksums.txt``, a ``my_engine``
module, a FlashInfer usage record), with ``DISTCACHE_ORIGIN`` pointing at a loopback
origin and ``DISTCACHE_POOL`` at a scratch pool. ``make demo`` and ``make test`` are
the two commands CI itself runs, so they are not run again from inside the suite.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import manifest_text
from distcache.store._pool import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.launchers.procs import REPO, base_env, run_group

README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
PYTHON = [body for lang, body in BLOCKS if lang == "python"]
COMMANDS = [
    line.strip()
    for lang, body in BLOCKS
    if lang == "bash"
    for line in body.splitlines()
    if line.strip() and not line.startswith("make ")
]
K = 5
ENGINE = """\
import os
from distcache.store._pool import ArtifactPool
pool = ArtifactPool(os.environ["DISTCACHE_POOL"])
print("ENGINE", os.environ["RANK"], sum(1 for _ in pool.objects()), flush=True)
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    artifacts = make_artifacts(tmp_path / "origin", K, min_size=2_000, max_size=20_000, seed=9)
    work = tmp_path / "work"
    work.mkdir()
    (work / "checksums.txt").write_text(manifest_text(artifacts))
    (work / "my_engine.py").write_text(ENGINE)
    (work / "fi-record").mkdir()
    (work / "fi-record" / "host-1-rank0.txt").write_text(manifest_text(artifacts[:2]))
    with LoopbackOrigin(tmp_path / "origin") as srv:
        yield work, srv.url


def _env(work: Path, url: str, **extra: str) -> dict[str, str]:
    env = base_env(
        DISTCACHE_ORIGIN=url,
        DISTCACHE_POOL=str(work / "pool"),
        DISTCACHE_FLASHINFER="0",
        # Four ranks on a machine that may have fewer cores, as the README is run here.
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        PATH=f"{Path(sys.executable).parent}:{base_env()['PATH']}",
        **extra,
    )
    return env


def _bash(line: str, work: Path, env: dict[str, str]) -> str:
    done = run_group(["bash", "-c", f"cd {work} && {line}"], env, timeout=300)
    assert done.returncode == 0, f"{line}\n{done.output}"
    return done.output


def test_the_readme_has_snippets_and_commands_to_run() -> None:
    assert len(PYTHON) >= 1
    assert any(c.startswith("mpirun") for c in COMMANDS)
    assert any(c.startswith("srun") for c in COMMANDS)
    assert any(c.startswith("distcache pool") for c in COMMANDS)


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_snippet_runs_as_written(index: int, workdir: tuple[Path, str]) -> None:
    work, url = workdir
    (work / "snippet.py").write_text(PYTHON[index])
    _bash(f"{sys.executable} snippet.py", work, _env(work, url))
    assert sum(1 for _ in ArtifactPool(work / "pool").objects()) == K


def test_shell_commands_run_as_written(
    workdir: tuple[Path, str], slurm_env: dict[str, str]
) -> None:
    work, url = workdir
    env = _env(work, url, SLURM_CONF=slurm_env["SLURM_CONF"])
    ran = []
    for line in COMMANDS:
        # The one path the README names for a pool lands in the scratch directory.
        out = _bash(line.replace("/tmp/distcache-pool", str(work / "launch-pool")), work, env)
        if "my_engine" in line:
            # The engine starts after the prefetch and finds every artifact in its pool.
            ranks = re.findall(r"ENGINE (\d+) (\d+)", out)
            assert sorted(r for r, _ in ranks) == ["0", "1", "2", "3"], out
            assert {n for _, n in ranks} == {str(K)}, out
        ran.append(line)
    assert ran == COMMANDS
