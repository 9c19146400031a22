"""Every snippet and command of the README and of ``docs/`` runs as written.

Each page is run on its own, as a reader follows it: its Python snippets run as
programs and its shell commands as lines of ``bash``, in order, in a scratch directory
that holds what they name (``checksums.txt``, a ``my_engine`` module, a FlashInfer
usage record), with ``DISTCACHE_ORIGIN`` pointing at a loopback origin and
``DISTCACHE_POOL`` at a scratch pool. Blocks fenced ``bash`` and ``python`` run; ``sh``
and ``py`` blocks show commands for a real cluster or engine and do not. ``make demo``
and ``make test`` are the two commands CI itself runs, so they are not run again from
inside the suite.
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

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: Fenced blocks that run, and those that only show (a real cluster, an engine, output).
RUNNABLE = {"bash", "python"}
SHOWN = {"sh", "py", "text"}
#: The node-local pool path the pages name, mapped into the scratch directory.
NAMED_POOL = "/local_nvme/distcache"


def _blocks(page: Path) -> list[tuple[str, str]]:
    return FENCE.findall(page.read_text())


def _python(page: Path) -> list[str]:
    return [body for lang, body in _blocks(page) if lang == "python"]


def _commands(page: Path) -> list[str]:
    return [
        line.strip()
        for lang, body in _blocks(page)
        if lang == "bash"
        for line in body.splitlines()
        if line.strip() and not line.startswith("make ")
    ]


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


SNIPPETS = [(page, i) for page in PAGES for i in range(len(_python(page)))]
COMMAND_PAGES = [page for page in PAGES if _commands(page)]
ALL_COMMANDS = [line for page in PAGES for line in _commands(page)]
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
        # Four ranks on a machine that may have fewer cores, as the pages are run here.
        PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
        PATH=f"{Path(sys.executable).parent}:{base_env()['PATH']}",
        **extra,
    )
    return env


def _bash(line: str, work: Path, env: dict[str, str]) -> str:
    done = run_group(["bash", "-c", f"cd {work} && {line}"], env, timeout=300)
    assert done.returncode == 0, f"{line}\n{done.output}"
    return done.output


def test_the_pages_have_snippets_and_commands_to_run() -> None:
    assert REPO / "README.md" in COMMAND_PAGES
    assert len(SNIPPETS) >= 2
    assert any(c.startswith("mpirun") for c in ALL_COMMANDS)
    assert any(c.startswith("srun") for c in ALL_COMMANDS)
    assert any(c.startswith("distcache pool") for c in ALL_COMMANDS)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_is_marked_runnable_or_shown(page: Path) -> None:
    # An unmarked or misspelt fence would silently drop its commands from this test.
    langs = {lang for lang, _ in _blocks(page)}
    assert langs <= RUNNABLE | SHOWN, f"{_name(page)}: fences {sorted(langs - RUNNABLE - SHOWN)}"


@pytest.mark.parametrize(("page", "index"), SNIPPETS,
                         ids=[f"{_name(p)}-{i}" for p, i in SNIPPETS])
def test_python_snippet_runs_as_written(page: Path, index: int,
                                        workdir: tuple[Path, str]) -> None:
    work, url = workdir
    (work / "snippet.py").write_text(_python(page)[index])
    _bash(f"{sys.executable} snippet.py", work, _env(work, url))
    assert sum(1 for _ in ArtifactPool(work / "pool").objects()) == K


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=_name)
def test_shell_commands_run_as_written(page: Path, workdir: tuple[Path, str],
                                       request: pytest.FixtureRequest) -> None:
    work, url = workdir
    commands = _commands(page)
    extra: dict[str, str] = {}
    if any(c.startswith("srun") for c in commands):
        extra["SLURM_CONF"] = request.getfixturevalue("slurm_env")["SLURM_CONF"]
    env = _env(work, url, **extra)
    ran = []
    for line in commands:
        # The one pool path the pages name lands in the scratch directory.
        out = _bash(line.replace(NAMED_POOL, str(work / "launch-pool")), work, env)
        if "my_engine" in line:
            # The engine starts after the prefetch and finds every artifact in its pool.
            ranks = re.findall(r"ENGINE (\d+) (\d+)", out)
            assert sorted(r for r, _ in ranks) == ["0", "1", "2", "3"], out
            assert {n for _, n in ranks} == {str(K)}, out
        ran.append(line)
    assert ran == commands
