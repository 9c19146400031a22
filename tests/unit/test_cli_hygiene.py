"""``distcache pool rm`` and ``pool prune`` through the real command line: dry runs
change nothing, removals need --yes without a terminal, shared bytes survive, and bad
globs and durations are clear errors."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from distcache.artifact import sha256_hex
from tests.unit.test_pool_import import (
    FILES,
    PIN,
    REPO,
    Run,
    cli_runner,
    make_wheel,
    objects,
    on_a_terminal,
    pool_labels,
)


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return cli_runner(tmp_path)


@pytest.fixture
def pool(tmp_path: Path, run: Run) -> Path:
    root = tmp_path / "pool"
    done = run("--pool", str(root), "pool", "import", str(make_wheel(tmp_path / "w.whl")))
    assert done.returncode == 0, done.stderr
    return root


def test_rm_dry_run_lists_and_changes_nothing(pool: Path, run: Run) -> None:
    before = pool_labels(run, pool)
    done = run("--pool", str(pool), "pool", "rm", f"{PIN}/*Sm90a*", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "would remove 1 labels and 1 objects" in done.stdout
    assert f"{PIN}/fmhaSm90aKernel_QBf16H128.cubin" in done.stdout
    assert pool_labels(run, pool) == before


def test_rm_without_yes_and_without_a_terminal_refuses(pool: Path, run: Run) -> None:
    done = run("--pool", str(pool), "pool", "rm", f"{PIN}/*")
    assert done.returncode == 2 and "pass --yes" in done.stderr
    assert len(objects(pool)) == 4


@pytest.mark.parametrize(("answer", "code"), [(b"n\n", 1), (b"y\n", 0)])
def test_rm_on_a_terminal_asks_first(pool: Path, answer: bytes, code: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env["PYTHONPATH"] = str(REPO)
    got, out = on_a_terminal(["--pool", str(pool), "pool", "rm", f"{PIN}/*Sm90a*"], env, answer)
    assert got == code, out
    assert b"[y/N]" in out
    assert len(objects(pool)) == (4 if code else 3)


def test_rm_removes_the_labels_and_the_objects_only_they_use(pool: Path, run: Run) -> None:
    # A second name for the sm100 bytes keeps them alive.
    alias = pool.parent / "alias"
    alias.mkdir()
    (alias / "copy.cubin").write_bytes(FILES["fmhaSm100aKernel_QBf16H128.cubin"])
    assert run("--pool", str(pool), "pool", "import", str(alias)).returncode == 0
    done = run("--pool", str(pool), "pool", "rm", f"{PIN}/*.cubin", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["labels_removed"] == 2 and report["objects_removed"] == 1
    labels = pool_labels(run, pool)
    assert set(labels) == {f"{PIN}/checksums.txt", f"{PIN}/include/flashInferMetaInfo.h",
                           "copy.cubin"}
    assert len(objects(pool)) == 3


def test_rm_of_an_unknown_name_and_a_bad_glob_are_errors(pool: Path, run: Run) -> None:
    done = run("--pool", str(pool), "pool", "rm", "no/such/name", "--yes")
    assert done.returncode == 1 and "no label" in done.stderr
    bad = run("--pool", str(pool), "pool", "rm", "abc[def", "--yes")
    assert bad.returncode == 1 and "unclosed '['" in bad.stderr
    assert len(objects(pool)) == 4


def test_prune_removes_what_was_not_used_for_the_duration(pool: Path, run: Run) -> None:
    old = time.time() - 40 * 86400
    cubins = {sha256_hex(d) for n, d in FILES.items() if n.endswith(".cubin")}
    stale = [p for p in objects(pool) if any(sha in p.name for sha in cubins)]
    assert len(stale) == 2
    for path in stale:
        os.utime(path, (old, old))
    dry = run("--pool", str(pool), "pool", "prune", "--older-than", "30d", "--dry-run")
    assert dry.returncode == 0 and f"would remove 2 labels and {len(stale)} objects" in dry.stdout
    done = run("--pool", str(pool), "pool", "prune", "--older-than", "30d", "-y")
    assert done.returncode == 0, done.stderr
    assert len(objects(pool)) == 4 - len(stale)
    assert not any(name.endswith(".cubin") for name in pool_labels(run, pool))
    again = run("--pool", str(pool), "pool", "prune", "--older-than", "30d", "-y")
    assert again.returncode == 0 and "nothing to remove" in again.stdout


@pytest.mark.parametrize("duration", ["30", "3x", "-1d", "d", ""])
def test_prune_refuses_a_bad_duration(pool: Path, run: Run, duration: str) -> None:
    done = run("--pool", str(pool), "pool", "prune", f"--older-than={duration}", "--yes")
    assert done.returncode == 2  # an option's value: bad usage
    assert "bad duration" in done.stderr and "30d" in done.stderr
    assert len(objects(pool)) == 4


def test_rm_on_a_missing_pool_is_an_error_and_creates_nothing(tmp_path: Path, run: Run) -> None:
    done = run("--pool", str(tmp_path / "none"), "pool", "rm", "x", "--yes")
    assert done.returncode == 1
    assert not (tmp_path / "none").exists()
