"""Recency of the objects a job holds, explicit and absurd caps, label counts and the
trimming of quarantine/."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.cli import main
from distcache.cli._common import human_bytes
from distcache.store import ArtifactPool

HOUR = 3600.0


def _age(path: Path | str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _mtime(path: Path | str) -> float:
    return os.lstat(path).st_mtime


# -- objects a job holds count as used now -----------------------------------------


def test_holding_an_object_found_present_refreshes_its_recency_stamp(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    held = pool.put(b"held" * 100)
    _age(pool.layout.object_path(held), HOUR)
    pool.hold([held])
    assert _mtime(pool.layout.object_path(held)) > time.time() - pool.stamp_interval


def test_a_collection_after_a_hold_removes_the_object_not_held(tmp_path: Path) -> None:
    # The start-up found both present and is about to load ``held``: a later
    # least-recently-used collection takes the other one, although ``held`` was older.
    pool = ArtifactPool(tmp_path / "pool")
    held = pool.put(b"h" * 1000)
    other = pool.put(b"o" * 1000)
    _age(pool.layout.object_path(held), 2 * HOUR)
    _age(pool.layout.object_path(other), HOUR)
    pool.hold([held])
    report = ArtifactPool(tmp_path / "pool").gc(1500)
    assert report.removed == 1
    assert pool.has(held) and not pool.has(other)


def test_a_hold_within_a_capped_batch_refreshes_the_stamp_too(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool", max_bytes=10_000)
    held = pool.put(b"c" * 100)
    _age(pool.layout.object_path(held), HOUR)
    with pool.batch():
        pool.hold([held])
    assert _mtime(pool.layout.object_path(held)) > time.time() - pool.stamp_interval


def test_a_recent_stamp_is_left_as_it_is(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"recent" * 10)
    path = pool.layout.object_path(sha)
    _age(path, pool.stamp_interval / 2)
    before = os.lstat(path).st_mtime_ns
    pool.hold([sha])
    assert os.lstat(path).st_mtime_ns == before


def test_a_stamp_that_cannot_be_written_does_not_fail_the_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool", max_bytes=10_000)
    sha = pool.put(b"foreign" * 10)
    _age(pool.layout.object_path(sha), HOUR)
    calls: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append(args[0])
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "utime", refuse)
    with pool.batch():
        pool.hold([sha])  # another user's object: used as it is
    monkeypatch.undo()
    assert calls, "the stale stamp was not tried"
    assert pool.get(sha) == b"foreign" * 10


def test_a_read_only_pool_stamps_nothing_on_hold(tmp_path: Path) -> None:
    sha = ArtifactPool(tmp_path / "pool").put(b"ro" * 50)
    path = ArtifactPool(tmp_path / "pool").layout.object_path(sha)
    _age(path, HOUR)
    before = os.lstat(path).st_mtime_ns
    ArtifactPool(tmp_path / "pool", read_only=True).hold([sha])
    assert os.lstat(path).st_mtime_ns == before


def test_a_symlink_at_an_object_name_is_not_followed_by_a_hold(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"linked" * 10)
    path = Path(pool.layout.object_path(sha))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the pool's")
    _age(outside, HOUR)
    before = os.stat(outside).st_mtime_ns
    path.unlink()
    path.symlink_to(outside)
    pool.hold([sha])
    assert os.stat(outside).st_mtime_ns == before


def test_hold_still_refuses_a_malformed_sha(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ArtifactPool(tmp_path / "pool").hold(["not-a-sha"])


# -- an explicit --max-bytes wins over the environment --------------------------------


def _two_objects(root: Path) -> tuple[str, str]:
    pool = ArtifactPool(root)
    old, new = pool.put(b"1" * 100), pool.put(b"2" * 100)
    _age(pool.layout.object_path(old), HOUR)
    return old, new


def test_gc_with_max_bytes_ignores_a_bad_environment_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    old, new = _two_objects(tmp_path / "pool")
    monkeypatch.setenv("DISTCACHE_POOL_MAX_BYTES", "bogus")
    code = main(["pool", "gc", "--pool", str(tmp_path / "pool"), "--max-bytes", "150"])
    assert code == 0, capsys.readouterr().err
    pool = ArtifactPool(tmp_path / "pool", max_bytes=0)
    assert not pool.has(old) and pool.has(new)


def test_gc_without_max_bytes_still_names_the_bad_environment_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_objects(tmp_path / "pool")
    monkeypatch.setenv("DISTCACHE_POOL_MAX_BYTES", "bogus")
    assert main(["pool", "gc", "--pool", str(tmp_path / "pool")]) == 1
    err = capsys.readouterr().err
    assert "DISTCACHE_POOL_MAX_BYTES='bogus'" in err


# -- stats counts the labels of present objects only ----------------------------------


def test_stats_counts_only_labels_whose_objects_are_present(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    kept, gone = pool.put(b"kept" * 100), pool.put(b"gone" * 100)
    pool.remember([Artifact("kept.cubin", kept), Artifact("gone.cubin", gone),
                   Artifact("alias.cubin", kept)])
    _age(pool.layout.object_path(gone), HOUR)
    pool.gc(400)
    assert pool.has(kept) and not pool.has(gone)
    assert pool.stats().names == 2
    assert main(["pool", "stats", "--pool", str(pool.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["names"] == 2


# -- quarantine/ is trimmed of every kind of entry ------------------------------------


def test_a_planted_directory_moved_to_quarantine_is_trimmed(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"d" * 10)
    path = Path(pool.layout.object_path(sha))
    path.unlink()
    (path / "inner").mkdir(parents=True)
    (path / "inner" / "file").write_bytes(b"x")
    pool.quarantine_keep = 0
    assert pool.get(sha) is None
    assert pool.quarantined == 1
    assert list(pool.layout.quarantine.iterdir()) == []


def test_gc_trims_quarantine_of_every_kind_without_following_links(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    quarantine = pool.layout.quarantine
    made = []
    for i in range(6):
        name = Path(pool.layout.quarantine_path(f"{i:064x}")).name
        made.append(name)
        entry = quarantine / name
        if i == 0:
            entry.mkdir()
            (entry / "escape").symlink_to(outside)
            (entry / "sub").mkdir()
            (entry / "sub" / "f").write_bytes(b"x")
        elif i == 1:
            os.mkfifo(entry)
        elif i == 2:
            entry.symlink_to(outside)
        else:
            entry.write_bytes(b"bad")
        time.sleep(0.002)  # distinct times in the names
    (quarantine / "operator-notes").write_text("left alone")
    pool.quarantine_keep = 2
    pool.gc()
    assert sorted(p.name for p in quarantine.iterdir()) == sorted(
        [*made[-2:], "operator-notes"])
    assert (outside / "precious").read_bytes() == b"keep me"


def test_gc_keeps_the_newest_quarantined_entries(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    names = []
    for i in range(3):
        name = Path(pool.layout.quarantine_path(f"{i:064x}")).name
        (pool.layout.quarantine / name).mkdir()
        names.append(name)
        time.sleep(0.002)
    pool.gc()  # the default keeps 16
    assert sorted(p.name for p in pool.layout.quarantine.iterdir()) == sorted(names)


# -- absurd caps ------------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "shown"), [
    (str(2**50), "1.0 PiB"),
    (str(3 * 2**60), "3.0 EiB"),
    (str(2**63 - 1), "8.0 EiB"),
])
def test_stats_prints_a_huge_cap_readably(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        cap: str, shown: str) -> None:
    ArtifactPool(tmp_path / "pool").put(b"s")
    monkeypatch.setenv("DISTCACHE_POOL_MAX_BYTES", cap)
    assert main(["pool", "stats", "--pool", str(tmp_path / "pool")]) == 0
    out = capsys.readouterr().out
    assert f"max_bytes: {cap} ({shown})" in out
    assert "TiB" not in out


def test_an_absurd_cap_is_no_practical_cap(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = 10**400
    pool = ArtifactPool(tmp_path / "pool", max_bytes=cap)
    shas = [pool.put(bytes([i]) * 1000) for i in range(3)]
    with pool.batch():
        shas.append(pool.put(b"batch" * 100))
    assert all(pool.has(s) for s in shas)
    report = pool.gc()
    assert (report.removed, report.kept) == (0, 4)
    assert "1.0e+400 B" in human_bytes(cap)


@pytest.mark.parametrize("cap", ["1" + "0" * 30, "1" + "0" * 400])
def test_a_cap_past_any_filesystem_is_refused_where_a_user_types_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        cap: str) -> None:
    # Taken as "no cap" before; a size no filesystem holds is a typo.
    ArtifactPool(tmp_path / "pool").put(b"s")
    assert main(["pool", "gc", "--pool", str(tmp_path / "pool"), "--max-bytes", cap]) == 2
    assert "more bytes than any filesystem holds" in capsys.readouterr().err
    monkeypatch.setenv("DISTCACHE_POOL_MAX_BYTES", cap)
    assert main(["pool", "stats", "--pool", str(tmp_path / "pool")]) == 1
    assert "DISTCACHE_POOL_MAX_BYTES" in capsys.readouterr().err


def test_a_quarantined_entry_that_cannot_be_removed_is_logged_not_raised(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    pool = ArtifactPool(tmp_path / "pool")
    stuck = Path(pool.layout.quarantine_path("a" * 64))
    stuck.mkdir()

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    pool.quarantine_keep = 0
    caplog.set_level(logging.WARNING, logger="distcache")
    pool.gc()
    assert stuck.is_dir()
    assert f"cannot remove 1 old entries of {pool.layout.quarantine}" in caplog.text
    assert "Permission denied" in caplog.text
