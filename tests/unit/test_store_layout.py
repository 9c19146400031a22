"""The pool's on-disk layout and format version (distcache.store.layout)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

import distcache.store
from distcache.artifact import Artifact
from distcache.errors import PoolError
from distcache.store import Identity, Pool, _maintenance, layout
from distcache.store._identity import PoolIdentity
from distcache.store._pool import ArtifactPool
from distcache.store.layout import FORMAT_VERSION, PoolLayout

DATA = b"kernel bytes\n"
DIGEST = hashlib.sha256(DATA).hexdigest()


def _legacy_pool(root: Path) -> ArtifactPool:
    """A pool as written before the format file existed: objects/, pool_id, no format."""
    pool = ArtifactPool(root)
    pool.put(DATA)
    pool.remember([Artifact("a/k.cubin", DIGEST)])
    os.unlink(root / "format")
    return pool


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a directory)."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        found[str(path.relative_to(root))] = None if path.is_dir() else path.read_bytes()
    return found


# -- paths ------------------------------------------------------------------------------


def test_layout_names_every_path_under_the_root(tmp_path: Path) -> None:
    at = PoolLayout(tmp_path / "p")
    root = tmp_path / "p"
    assert at.root == root
    assert (at.format_file, at.pool_id_file) == (root / "format", root / "pool_id")
    assert (at.names_log, at.journal_log) == (root / "names.log", root / "journal.log")
    assert at.directories == (root / "objects", root / "tmp", root / "quarantine", root / "locks")
    assert at.fanout(DIGEST) == str(root / "objects" / DIGEST[:2])
    assert at.object_path(DIGEST) == str(root / "objects" / DIGEST[:2] / DIGEST)
    assert at.lock_path(DIGEST) == root / "locks" / f"{DIGEST}.lock"
    assert Path(at.temp_path("tag", "host")).parent == root / "tmp"
    assert at.temp_path("tag", "host") != at.temp_path("tag", "host")
    assert at.probe_path("ab" * 16) == str(root / "tmp" / f"probe.{'ab' * 16}")
    assert at.id_lock_path() == root / "locks" / "pool_id.lock"


def test_layout_of_a_relative_root_is_absolute_and_touches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    at = PoolLayout(Path("rel"))
    assert at.root == tmp_path / "rel" and at == PoolLayout(tmp_path / "rel")
    assert not at.is_pool()
    assert os.listdir(tmp_path) == []


def test_pool_puts_each_file_where_its_layout_says(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "p")
    pool.put(DATA)
    pool.remember([Artifact("k.cubin", DIGEST)])
    at = pool.layout
    assert at.is_pool() and at == PoolLayout(tmp_path / "p")
    assert Path(at.object_path(DIGEST)).read_bytes() == DATA
    assert at.pool_id_file.read_text().strip() == pool.pool_id
    assert at.format_file.read_text() == f"{FORMAT_VERSION}\n"
    assert DIGEST in at.journal_log.read_text() and "k.cubin" in at.names_log.read_text()
    assert all(d.is_dir() for d in at.directories)


def test_quarantine_names_carry_their_time_and_foreign_names_have_none(tmp_path: Path) -> None:
    at = PoolLayout(tmp_path)
    first = at.quarantine_path(DIGEST)
    second = at.quarantine_path(DIGEST)
    assert first.parent == at.quarantine and first != second
    when = at.quarantined_at(first.name)
    assert when is not None and when <= (at.quarantined_at(second.name) or 0)
    for foreign in ("notes.txt", f"{DIGEST}.x.1.ab", f"{DIGEST[:10]}.1.1.ab", DIGEST):
        assert at.quarantined_at(foreign) is None


def test_front_exports_the_layout_and_the_report_types() -> None:
    assert distcache.store.PoolLayout is PoolLayout
    assert distcache.store.FORMAT_VERSION == FORMAT_VERSION == layout.FORMAT_VERSION
    assert isinstance(FORMAT_VERSION, int) and FORMAT_VERSION >= 1
    assert {"ArtifactPool", "GcReport", "PoolStats", "VerifyReport"} <= set(
        distcache.store.__all__)


def test_the_pool_protocol_is_declared_once_and_the_pool_implements_it(tmp_path: Path) -> None:
    assert {"Pool", "Identity"} <= set(distcache.store.__all__)
    pool = ArtifactPool(tmp_path / "p")
    assert {n for n in vars(Pool) if not n.startswith("_")} <= set(dir(pool))
    assert {n for n in vars(Identity) if not n.startswith("_")} <= set(dir(pool.identity))
    assert isinstance(pool.identity, PoolIdentity)


def test_maintenance_works_on_a_layout_without_a_pool_object(tmp_path: Path) -> None:
    ArtifactPool(tmp_path / "p").put(DATA)
    at = PoolLayout(tmp_path / "p")
    listed = _maintenance.stats(at, pool_id="x" * 32, names=0, max_bytes=None)
    assert (listed.objects, listed.bytes) == (1, len(DATA))
    report = _maintenance.gc(at, 0)
    assert (report.removed, report.kept) == (1, 0)
    assert not os.path.exists(at.object_path(DIGEST))


# -- format version ---------------------------------------------------------------------


def test_a_new_pool_records_the_current_format_read_only(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "p")
    assert pool.format_version == FORMAT_VERSION
    assert pool.layout.read_format() == FORMAT_VERSION
    mode = stat.S_IMODE(os.stat(pool.layout.format_file).st_mode)
    assert mode & 0o222 == 0
    assert os.listdir(pool.layout.tmp) == []


def test_a_pool_without_format_file_is_migrated_to_format_1_in_place_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "p"
    old = _legacy_pool(root)
    before = _tree(root)
    assert "format" not in before
    caplog.set_level(logging.INFO, logger="distcache.store.layout")
    first = ArtifactPool(root)
    again = ArtifactPool(root)
    assert first.format_version == again.format_version == 1
    assert (root / "format").read_text() == "1\n"
    after = _tree(root)
    assert after.pop("format") == b"1\n"
    assert after == before  # nothing else changed: objects, pool_id, logs, directories
    assert first.pool_id == old.pool_id and first.get(DIGEST) == DATA
    assert first.names() == {"a/k.cubin": DIGEST}
    migrated = [r for r in caplog.records if "predates format versions" in r.getMessage()]
    assert len(migrated) == 1 and str(root) in migrated[0].getMessage()


def test_a_read_only_legacy_pool_is_read_as_format_1_without_recording_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "p"
    _legacy_pool(root)

    def refuse(path: Path, *args: object, **kwargs: object) -> bool:
        raise PoolError(f"cannot create {path}: read-only", path=str(path), errno=30)

    monkeypatch.setattr(layout, "create_once", refuse)
    caplog.set_level(logging.WARNING, logger="distcache.store.layout")
    pool = ArtifactPool(root)
    assert pool.format_version == 1 and pool.get(DIGEST) == DATA
    assert not (root / "format").exists()
    assert any("reading it as format 1" in r.getMessage() for r in caplog.records)


def test_a_pool_of_a_newer_format_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "p"
    root.mkdir()
    newer = FORMAT_VERSION + 1
    (root / "format").write_text(f"{newer}\n")
    with pytest.raises(PoolError) as info:
        ArtifactPool(root)
    message = str(info.value)
    assert f"format {newer}" in message and f"format {FORMAT_VERSION}" in message
    assert "upgrade distcache" in message and "DISTCACHE_POOL" in message
    assert info.value.path == str(root / "format")  # type: ignore[attr-defined]
    assert os.listdir(root) == ["format"]


@pytest.mark.parametrize("text", ["two", "0", "-1", "1.5", "1 2", "\uff11", "9" * 40])
def test_a_malformed_format_file_is_a_clear_pool_error(tmp_path: Path, text: str) -> None:
    root = tmp_path / "p"
    root.mkdir()
    (root / "format").write_text(text)
    with pytest.raises(PoolError, match="not a pool format version") as info:
        ArtifactPool(root)
    assert str(root / "format") in str(info.value) and "DISTCACHE_POOL" in str(info.value)
    assert os.listdir(root) == ["format"]


def test_an_empty_format_file_is_an_error_not_a_hang(tmp_path: Path) -> None:
    root = tmp_path / "p"
    root.mkdir()
    (root / "format").write_bytes(b"")
    with pytest.raises(PoolError, match="stays empty"):
        ArtifactPool(root)


def test_a_symlink_in_place_of_the_format_file_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "p"
    root.mkdir()
    (tmp_path / "elsewhere").write_text(f"{FORMAT_VERSION}\n")
    os.symlink(tmp_path / "elsewhere", root / "format")
    with pytest.raises(PoolError, match="cannot read pool format version"):
        ArtifactPool(root)


def test_an_older_format_is_brought_up_by_its_migration_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "p"
    ArtifactPool(root).put(DATA)
    ran: list[Path] = []
    monkeypatch.setattr(layout, "FORMAT_VERSION", 2)
    monkeypatch.setattr(layout, "_MIGRATIONS", {1: lambda at: ran.append(at.root)})
    caplog.set_level(logging.INFO, logger="distcache.store.layout")
    pool = ArtifactPool(root)
    assert ran == [root] and pool.format_version == 2
    assert (root / "format").read_text() == "2\n"
    assert pool.get(DIGEST) == DATA and os.listdir(root / "tmp") == []
    ArtifactPool(root)
    assert ran == [root]  # recorded: the step does not run again
    assert sum("from format 1 to format 2" in r.getMessage() for r in caplog.records) == 1


def test_an_older_format_without_a_migration_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "p"
    ArtifactPool(root)
    monkeypatch.setattr(layout, "FORMAT_VERSION", 2)
    monkeypatch.setattr(layout, "_MIGRATIONS", {})
    with pytest.raises(PoolError, match=r"format 1, which .* cannot migrate"):
        ArtifactPool(root)
    assert (root / "format").read_text() == "1\n"


def test_concurrent_creators_record_one_format(tmp_path: Path) -> None:
    root = tmp_path / "p"
    barrier = threading.Barrier(6)
    versions: list[int] = []
    errors: list[BaseException] = []

    def open_pool() -> None:
        barrier.wait()
        try:
            versions.append(ArtifactPool(root).format_version)
        except BaseException as exc:  # reported below, with the thread's result
            errors.append(exc)

    threads = [threading.Thread(target=open_pool) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and versions == [FORMAT_VERSION] * 6
    assert (root / "format").read_text() == f"{FORMAT_VERSION}\n"
    assert os.listdir(root / "tmp") == []


# -- identity: the pool id and the probes (distcache.store._identity) ----------------

NAME, TOKEN = "1f" * 16, "c3" * 16


def test_a_probe_is_readable_by_the_pool_s_readers_and_gone_after_its_block(
    tmp_path: Path,
) -> None:
    pool = ArtifactPool(tmp_path / "p")
    other = ArtifactPool(tmp_path / "p")  # another process opening the same directory
    path = Path(pool.layout.probe_path(NAME))
    with pool.identity.probe(NAME, TOKEN) as placed:
        assert placed and path.read_text() == TOKEN
        assert stat.S_IMODE(path.stat().st_mode) & 0o444 == 0o444 & ~_umask()
        assert other.identity.sees(NAME, TOKEN)
        assert not other.identity.sees(NAME, "c4" * 16)  # the content is the proof
        assert not other.identity.sees("2f" * 16, TOKEN)
    assert not path.exists() and not other.identity.sees(NAME, TOKEN)


def test_a_probe_is_removed_when_its_block_fails(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "p")
    with pytest.raises(RuntimeError), pool.identity.probe(NAME, TOKEN):
        raise RuntimeError("the collective failed")
    assert list((tmp_path / "p" / "tmp").glob("probe.*")) == []


@pytest.mark.parametrize("name", ["../../escape", "1f" * 15, "ZZ" * 16, "1f" * 16 + "/x"])
def test_a_malformed_probe_name_from_a_peer_is_never_a_path(tmp_path: Path, name: str) -> None:
    pool = ArtifactPool(tmp_path / "p")
    (tmp_path / "escape").write_text(TOKEN)
    with pool.identity.probe(name, TOKEN) as placed:
        assert not placed
    assert not pool.identity.sees(name, TOKEN)
    assert list((tmp_path / "p" / "tmp").glob("probe.*")) == []


def test_a_copy_renews_its_id_once_and_the_original_keeps_its_own(tmp_path: Path) -> None:
    original = ArtifactPool(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy, beside = ArtifactPool(tmp_path / "b"), ArtifactPool(tmp_path / "b")
    assert copy.pool_id == original.pool_id == beside.pool_id

    fresh = copy.identity.renew()

    assert fresh != original.pool_id and copy.pool_id == fresh
    assert ArtifactPool(tmp_path / "b").pool_id == fresh
    assert ArtifactPool(tmp_path / "a").pool_id == original.pool_id
    # Another process that still knows the old id adopts the renewal, never renews again.
    assert beside.identity.renew() == fresh and beside.pool_id == fresh
    assert ArtifactPool(tmp_path / "b").pool_id == fresh
    assert list((tmp_path / "b" / "tmp").iterdir()) == []
    assert original.identity.reload() == original.pool_id


def test_a_pool_id_that_cannot_be_replaced_is_a_pool_error(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "p")
    pool.layout.pool_id_file.unlink()
    pool.layout.pool_id_file.mkdir()  # neither readable as an id nor replaceable
    with pytest.raises(PoolError):
        pool.identity.renew()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
