"""``distcache prefetch`` under ``mpirun`` where one rank refuses its pool before the
first collective (a directory another tool owns, a file where the pool should be):
every rank ends with that rank's error, told to the others, instead of waiting out
``DISTCACHE_TIMEOUT`` in a collective that rank never joins and then blaming "a
crashed or stalled rank". And a pool this user cannot look into is refused by every
command with a line naming it, not a bare errno."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from distcache.testing._artifacts import make_artifacts
from tests.support.cli import cli_env
from tests.support.helpers import mpi_env, mpirun
from tests.support.process import run_group

pytestmark = pytest.mark.timeout(300)

#: Far longer than the job may take: a rank left waiting for the refused one makes the
#: launch run past the group's timeout, which fails the test.
_TIMEOUT_S = "600"


def _bad_pool(tmp_path: Path, kind: str) -> Path:
    bad = tmp_path / "bad"
    if kind == "foreign":
        (bad / "objects").mkdir(parents=True)  # another tool's directory
    else:
        bad.write_bytes(b"not a pool\n")
    return bad


def _refused_on_rank_1(cmd: list[str], env: dict[str, str]) -> str:
    """The merged output of a 2-rank launch whose rank 1 is refused, checked to end on
    both ranks with that rank's error (rank 0 told of it, not timed out)."""
    try:
        done = run_group(cmd, timeout=240, env=env, merge_stderr=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a rank waited for the refused one: {exc.output!r}")
    out = done.stdout
    assert done.returncode != 0, out
    assert "failed, so rank 0 stops" in out, out  # rank 0 heard rank 1's own error
    assert "did not complete within" not in out, out
    return out


@pytest.mark.parametrize("kind", ["foreign", "file"])
def test_a_pool_refused_on_one_rank_ends_the_job_on_every_rank(tmp_path: Path,
                                                               kind: str) -> None:
    make_artifacts(tmp_path / "set", 3, min_size=100, max_size=200)
    manifest = tmp_path / "set" / "checksums.txt"
    bad = _bad_pool(tmp_path, kind)
    env = mpi_env(cli_env(tmp_path), DISTCACHE_TIMEOUT=_TIMEOUT_S)
    rank_cmd = [sys.executable, "-m", "distcache", "prefetch", "--manifest", str(manifest),
                "--origin", str(tmp_path / "set")]
    cmd = [mpirun(), "-n", "1", "-x", f"DISTCACHE_POOL={tmp_path / 'good'}", *rank_cmd,
           ":", "-n", "1", "-x", f"DISTCACHE_POOL={bad}", *rank_cmd]
    out = _refused_on_rank_1(cmd, env)
    said = {"foreign": "is not a distcache pool", "file": "cannot create pool root"}[kind]
    assert out.count(said) >= 2, out  # rank 1's line, and rank 0's naming it
    assert "Errno" not in out, out


@pytest.mark.parametrize("command", [["pool", "stats"], ["pool", "ls"], ["pool", "verify"],
                                     ["prefetch", "--manifest", "{manifest}"],
                                     ["fetch", "--manifest", "{manifest}", "--origin", "{set}"]],
                         ids=["stats", "ls", "verify", "prefetch", "fetch"])
def test_a_pool_this_user_cannot_look_into_is_named(tmp_path: Path,
                                                    command: list[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("makes a pool only root may enter and runs as nobody: needs root")
    # Outside pytest's own directory, which only root may enter.
    base = Path(tempfile.mkdtemp(prefix="distcache-no-entry-"))
    try:
        os.chmod(base, 0o755)
        make_artifacts(base / "set", 2, min_size=100, max_size=200)
        pool = base / "pool"
        env = cli_env(tmp_path)
        made = subprocess.run([sys.executable, "-m", "distcache", "--pool", str(pool), "pool",
                               "import", str(base / "set")], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert made.returncode == 0, made.stderr
        os.chmod(pool, 0o700)  # as a pool made under umask 077 is, to every other user
        args = [a.format(manifest=base / "set" / "checksums.txt", set=base / "set")
                for a in command]
        done = run_group(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "--", sys.executable, "-m", "distcache", "--pool", str(pool), *args],
                         timeout=120, env={**env, "HOME": str(base)}, cwd="/")
    finally:
        shutil.rmtree(base)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"cannot look into the pool {pool}: Permission denied" in done.stderr, done.stderr
    assert "Errno" not in done.stderr, done.stderr


@pytest.mark.parametrize("kind", ["foreign", "file"])
def test_launch_peers_with_a_pool_refused_on_one_rank_ends_every_rank(tmp_path: Path,
                                                                      kind: str) -> None:
    # python -m launch --peers: the agents' start is collective; a rank whose pool is
    # refused tells the others, which end with its error.
    bad = _bad_pool(tmp_path, kind)
    before = sorted(p.name for p in bad.iterdir()) if bad.is_dir() else None
    env = mpi_env(cli_env(tmp_path), DISTCACHE_TIMEOUT=_TIMEOUT_S)
    rank_cmd = [sys.executable, "-m", "launch", "--peers", "--pool"]
    cmd = [mpirun(), "-n", "1", "-x", "DISTCACHE_NODE_ID=a", *rank_cmd, str(tmp_path / "good"),
           "--", "true", ":", "-n", "1", "-x", "DISTCACHE_NODE_ID=b", *rank_cmd, str(bad),
           "--", "true"]
    out = _refused_on_rank_1(cmd, env)
    if before is not None:  # another tool's directory: nothing written into it
        assert sorted(p.name for p in bad.iterdir()) == before, out
