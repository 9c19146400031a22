"""A capped pool keeps a run's whole set and holds its cap across processes; the
hygiene commands (``pool prune``, ``pool rm``, ``pool verify``) say what they did."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective import sync
from distcache.collective._download import download_objects
from distcache.comm import ThreadGroup
from distcache.origins._directory import DirOrigin
from distcache.store import ArtifactPool, _prune
from tests.support.cli import cli_env, run_cli
from tests.support.helpers import on_threads
from tests.support.process import run_group

DAY = 86400
A, B, Z = b"A" * 1000, b"B" * 1000, b"Z" * 1000

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="mounting a read-only tmpfs needs root",
)


def _age(pool: ArtifactPool, sha: str, seconds: float) -> None:
    when = time.time() - seconds
    os.utime(pool.layout.object_path(sha), (when, when))


def _pool(root: Path, items: list[tuple[str | None, bytes, float]]) -> ArtifactPool:
    """A pool holding ``(name or None, bytes, age in seconds)`` each."""
    pool = ArtifactPool(root, max_bytes=None)
    for name, data, age in items:
        sha = pool.put(data)
        if name is not None:
            pool.remember([Artifact(name, sha, len(data))])
        _age(pool, sha, age)
    return pool


def _origin(tmp_path: Path) -> Path:
    origin = tmp_path / "origin"
    origin.mkdir()
    lines = []
    for name, data in (("a.bin", A), ("b.bin", B)):
        (origin / name).write_bytes(data)
        lines.append(f"{sha256_hex(data)}  {name}\n")
    (origin / "checksums.txt").write_text("".join(lines))
    return origin


# -- 1. the cap never removes a run's own set -----------------------------------------


def test_a_capped_prefetch_keeps_the_manifest_objects_already_in_the_pool(
        tmp_path: Path) -> None:
    origin = _origin(tmp_path)
    root = tmp_path / "pool"
    _pool(root, [("a.bin", A, 10 * DAY), ("z.bin", Z, 5 * DAY)])  # A is the oldest
    env = {**cli_env(tmp_path), "DISTCACHE_POOL_MAX_BYTES": "2500",
           "DISTCACHE_ORIGIN": str(origin)}
    done = run_cli(env, "--pool", str(root), "prefetch", "--manifest",
                   str(origin / "checksums.txt"))
    assert done.returncode == 0, done.stderr
    held = set(ArtifactPool(root, read_only=True).objects())
    assert sha256_hex(A) in held and sha256_hex(B) in held
    assert sha256_hex(Z) not in held  # the unrelated object made room


def test_downloads_hold_an_object_found_present_for_the_batchs_collection(
        tmp_path: Path) -> None:
    origin = _origin(tmp_path)
    pool = _pool(tmp_path / "pool", [("a.bin", A, 10 * DAY), ("z.bin", Z, 5 * DAY)])
    pool.max_bytes = 2500
    got = download_objects(pool, DirOrigin(str(origin)),
                           [Artifact("a.bin", sha256_hex(A), 1000),
                            Artifact("b.bin", sha256_hex(B), 1000)], workers=1)
    assert got.failure is None and (got.downloads, got.placed) == (1, 1)
    assert pool.has(sha256_hex(A)) and pool.has(sha256_hex(B))
    assert not pool.has(sha256_hex(Z))


def test_downloads_begin_only_once_the_batch_holding_them_is_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An object found present is held only while a batch is open: a download thread
    # that ran before the batch opened found nothing to hold it in, and the capped
    # collection after the next publication removed it (the oldest object).
    origin = _origin(tmp_path)
    pool = _pool(tmp_path / "pool", [("a.bin", A, 10 * DAY), ("z.bin", Z, 5 * DAY)])
    pool.max_bytes = 2500
    opening = pool.batch

    @contextlib.contextmanager
    def late_batch(*args: Any, **kwargs: Any) -> Iterator[None]:
        time.sleep(0.5)  # ample time for a thread already started to run its downloads
        with opening(*args, **kwargs):
            yield

    monkeypatch.setattr(pool, "batch", late_batch)
    got = download_objects(pool, DirOrigin(str(origin)),
                           [Artifact("a.bin", sha256_hex(A), 1000),
                            Artifact("b.bin", sha256_hex(B), 1000)], workers=1)
    assert got.failure is None and (got.downloads, got.placed) == (1, 1)
    assert pool.has(sha256_hex(A)) and pool.has(sha256_hex(B))
    assert not pool.has(sha256_hex(Z))


def test_a_capped_sync_keeps_the_objects_of_its_set_already_in_the_pool(
        tmp_path: Path) -> None:
    pools = [ArtifactPool(tmp_path / "p0", max_bytes=None),
             ArtifactPool(tmp_path / "p1", max_bytes=None)]
    a, z = pools[0].put(A), pools[0].put(Z)

    def sync_all() -> list[object]:
        group = ThreadGroup(2, timeout=20)
        return on_threads(2, lambda r: sync(comm=group.comm(r), pool=pools[r]))

    assert not any(isinstance(r, BaseException) for r in sync_all())
    _age(pools[0], a, 10 * DAY)  # A is the oldest object of pool 0
    _age(pools[0], z, 5 * DAY)
    b = pools[1].put(B)  # news of pool 1: B, and a new label for A (in both pools)
    pools[1].remember([Artifact("again/a.bin", a, 1000)])
    pools[0].max_bytes = 2500
    assert not any(isinstance(r, BaseException) for r in sync_all())
    assert pools[0].has(b) and pools[0].has(a)
    assert not pools[0].has(z)


# -- 2. several processes on one capped pool -------------------------------------------

_CHILD = textwrap.dedent("""
    import os, sys, time
    from distcache.store import ArtifactPool
    root, me, other = sys.argv[1], sys.argv[2], sys.argv[3]
    pool = ArtifactPool(root)
    pool.put(os.urandom(500))  # the first publication measures the pool
    open(os.path.join(root, "..", me), "w").close()
    while not os.path.exists(os.path.join(root, "..", other)):
        time.sleep(0.01)  # both have measured before either goes on
    for _ in range(9):
        pool.put(os.urandom(1000))
""")


def test_two_processes_on_one_capped_pool_hold_its_cap_within_the_stated_bound(
        tmp_path: Path) -> None:
    root = tmp_path / "pool"
    ArtifactPool(root, max_bytes=None)
    env = {**cli_env(tmp_path), "DISTCACHE_POOL_MAX_BYTES": "10000"}
    cmd = [sys.executable, "-c",
           "import subprocess, sys\n"
           f"kids = [subprocess.Popen([sys.executable, '-c', {_CHILD!r}, {str(root)!r}, m, o])"
           " for m, o in (('one', 'two'), ('two', 'one'))]\n"
           "sys.exit(max(k.wait() for k in kids))\n"]
    done = run_group(cmd, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    total = sum(st.st_size for _p, _s, st in ArtifactPool(root, max_bytes=None)._store.scan())
    # Each process re-measures once it has published a sixteenth of the cap since its
    # last measurement: two processes overshoot by at most 2 x (10000/16 + 1000).
    assert total <= 10000 + 2 * (10000 // 16 + 1000), total


# -- 3. prune and rm report what they could not delete ---------------------------------


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs at ``tmp_path/mnt``; the test remounts it read-only."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@needs_root
def test_prune_on_a_read_only_pool_exits_1_and_says_nothing_was_deleted(
        tmp_path: Path, read_only_mount: Path) -> None:
    root = read_only_mount / "pool"
    _pool(root, [(None, b"U" * 100, 10 * DAY), (None, b"V" * 100, 10 * DAY),
                 ("b.bin", B, 0)])
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    done = run_cli(cli_env(tmp_path), "--pool", str(root), "pool", "prune",
                   "--older-than", "1d", "--yes", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(done.stdout)["objects_removed"] == 0
    assert json.loads(done.stdout)["objects_failed"] == 2
    assert "could not delete 2 of 2 objects" in done.stderr


def test_rm_exits_1_when_an_object_cannot_be_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from distcache.cli import main

    root = tmp_path / "pool"
    pool = _pool(root, [("a.bin", A, 0), ("b.bin", B, 0)])
    real_unlink = os.unlink

    def refused(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        if os.fspath(path).startswith(os.fspath(pool.layout.objects)):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        real_unlink(path)

    monkeypatch.setattr(_prune.os, "unlink", refused)
    assert main(["--pool", str(root), "pool", "rm", "a.bin", "--yes"]) == 1
    assert "could not delete 1 of 1 objects" in capsys.readouterr().err
    assert pool.has(sha256_hex(A))


# -- 4. an exact recorded name is never judged as a glob -------------------------------


def test_rm_takes_an_exact_recorded_name_with_an_unclosed_bracket(tmp_path: Path) -> None:
    root = tmp_path / "pool"
    name = "kernels/gemm[bf16.cubin"
    _pool(root, [(name, A, 0), ("other.bin", B, 0)])
    env = cli_env(tmp_path)
    done = run_cli(env, "--pool", str(root), "pool", "rm", name, "--yes")
    assert done.returncode == 0, done.stderr
    assert ArtifactPool(root, read_only=True).names() == {"other.bin": sha256_hex(B)}
    # A name that is not recorded is still judged as a glob.
    bad = run_cli(env, "--pool", str(root), "pool", "rm", "kernels/x[bf16", "--yes")
    assert bad.returncode == 1 and "unclosed '['" in bad.stderr


# -- 5. verify says what it moved and what it left -------------------------------------


def _corrupt_one(pool: ArtifactPool) -> str:
    sha = pool.put(b"W" * 100)
    path = pool.layout.object_path(sha)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"X")
    return sha


@needs_root
def test_verify_on_a_read_only_pool_does_not_claim_a_move(
        tmp_path: Path, read_only_mount: Path) -> None:
    root = read_only_mount / "pool"
    pool = _pool(root, [("b.bin", B, 0)])
    _corrupt_one(pool)
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    done = run_cli(cli_env(tmp_path), "--pool", str(root), "pool", "verify")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "corrupt object(s) moved to" not in done.stderr
    assert "1 corrupt object(s) could not be moved" in done.stderr


def test_verify_counts_moved_apart_from_left_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.store import _objects

    pool = _pool(tmp_path / "pool", [("b.bin", B, 0)])
    first, second = _corrupt_one(pool), pool.put(b"Y" * 100)
    path = pool.layout.object_path(second)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"X")
    real_move = _objects.move_aside

    def refuse_first(src: str, dest: str, st: object) -> bool:
        if os.path.basename(src) == first:
            raise OSError(errno.EROFS, "Read-only file system", src)
        return real_move(src, dest, st)  # type: ignore[arg-type]

    monkeypatch.setattr(_objects, "move_aside", refuse_first)
    report = pool.verify()
    assert (report.ok, report.corrupt, report.moved) == (1, 2, 1)
    assert pool.has(first) and not pool.has(second)
