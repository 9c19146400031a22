"""How far the cursors a pool keeps for the incremental sync are trusted: a damaged
cursor file, a pool copied or restored under the same id (its cursors say what reached
another copy, not it), and two jobs keeping their cursors in one pool at once."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.collective import SyncState, _cursors, _sync, sync
from distcache.collective._cursors import pools_key, store_cursor, stored_cursor
from distcache.comm import ThreadGroup
from distcache.errors import PrefetchError
from distcache.store._locking import FileLock
from distcache.store._pool import ArtifactPool
from tests.support.helpers import on_threads


def _sync_all(pools: list[ArtifactPool], states: list[SyncState] | None = None) -> list[object]:
    group = ThreadGroup(len(pools), timeout=20)
    return on_threads(len(pools), lambda r: sync(
        comm=group.comm(r), pool=pools[r], state=None if states is None else states[r]))


def _ok(results: list[object]) -> list[object]:
    assert not any(isinstance(x, BaseException) for x in results), results
    assert all(x == results[0] for x in results), results
    return results


def _cursor_keys(path: Path) -> list[str]:
    return [line.split(" ")[0] for line in path.read_bytes().decode("ascii").splitlines()]


# -- a damaged cursor file ------------------------------------------------------------


def test_a_damaged_cursor_line_is_dropped_and_every_sync_succeeds(tmp_path: Path) -> None:
    pools = [ArtifactPool(tmp_path / f"p{r}") for r in range(2)]
    pools[0].put(b"a kernel" * 100)
    # Another job's line with one byte flipped, beside one of a job that is intact.
    pools[0].layout.sync_cursor.write_bytes(
        b"0123456789abcd\xe9f 66 0000000a\nfedcba9876543210 0 00000000\n")
    for _ in range(2):
        _ok(_sync_all(pools))
    key = pools_key([p.pool_id for p in pools])
    assert stored_cursor(pools[0], key) == pools[0].journal_since(0)[1]
    assert _cursor_keys(pools[0].layout.sync_cursor) == ["fedcba9876543210", key]


def test_only_lines_keyed_as_a_sync_keys_them_are_kept(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"an object" * 50)
    _, end = pool.journal_since(0)
    kept = ["-", "0123456789abcdef"]
    dropped = ["0123456789ABCDEF", "0123456789abcdef0", "0123456789abcde", "x", "..",
               "0123456789abcde\u00e9"]
    pool.layout.sync_cursor.write_bytes("".join(
        f"{k} 0 00000000\n" for k in [*dropped[:3], *kept, *dropped[3:]]).encode())
    key = pools_key([pool.pool_id, "another pool"])
    store_cursor(pool, end, key=key)
    assert _cursor_keys(pool.layout.sync_cursor) == [*kept, key]
    assert stored_cursor(pool, key) == end


@pytest.mark.parametrize("key", ["caf\u00e9", "two words", "a\nline", ""])
def test_a_cursor_under_a_key_no_sync_writes_is_not_kept_and_raises_nothing(
        tmp_path: Path, key: str, caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"an object" * 50)
    _, end = pool.journal_since(0)
    store_cursor(pool, end, key="-")
    with caplog.at_level(logging.WARNING, logger="distcache"):
        store_cursor(pool, end, key=key)
    assert "cursor" in caplog.text
    assert _cursor_keys(pool.layout.sync_cursor) == ["-"]
    assert stored_cursor(pool, "-") == end


# -- a pool copied or restored under the same id ----------------------------------------


def test_a_fresh_copy_of_a_synced_pool_gets_what_the_other_pool_holds(tmp_path: Path) -> None:
    template = ArtifactPool(tmp_path / "image-pool")
    baked = template.put(b"baked kernel" * 100)
    template.remember([Artifact("base/k", baked)])
    for copy in ("copy1", "copy2"):
        shutil.copytree(template.root, tmp_path / copy, symlinks=True)
    c = ArtifactPool(tmp_path / "persistent")
    lazily = c.put(b"kernel fetched lazily on node C" * 100)
    c.remember([Artifact("lazy/k", lazily)])

    a1 = ArtifactPool(tmp_path / "copy1")
    _ok(_sync_all([a1, c]))  # one job
    assert a1.has(lazily)
    a2 = ArtifactPool(tmp_path / "copy2")  # a later job, on a fresh copy of the image
    assert a2.pool_id == a1.pool_id
    _ok(_sync_all([a2, c]))
    assert a2.has(lazily) and a2.names() == {"base/k": baked, "lazy/k": lazily}
    # The two now agree: a further sync lists nothing again.
    again = _ok(_sync_all([a2, c]))
    assert again[0].objects == 0  # type: ignore[attr-defined]


def _restored(pool: ArtifactPool, backup: Path) -> ArtifactPool:
    shutil.rmtree(pool.root)
    shutil.copytree(backup, pool.root, symlinks=True)
    return ArtifactPool(pool.root)


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "session-state"])
def test_a_pool_restored_from_a_backup_gets_what_it_missed(tmp_path: Path,
                                                           with_state: bool) -> None:
    a, b = (ArtifactPool(tmp_path / n) for n in ("a", "b"))
    states = [SyncState(), SyncState()] if with_state else None
    a.remember([Artifact("first", a.put(b"first build" * 40))])
    _ok(_sync_all([a, b], states))
    shutil.copytree(a.root, tmp_path / "backup", symlinks=True)
    later = b.put(b"built on b after the backup" * 40)
    b.remember([Artifact("later", later)])
    _ok(_sync_all([a, b], states))
    assert a.has(later)
    a = _restored(a, tmp_path / "backup")
    assert not a.has(later)
    _ok(_sync_all([a, b], states))
    assert a.has(later) and a.names().get("later") == later


def test_a_label_recorded_since_the_cursor_still_wins_when_all_is_sent_again(
        tmp_path: Path) -> None:
    a, b = (ArtifactPool(tmp_path / n) for n in ("a", "b"))
    old = a.put(b"the old build" * 40)
    a.remember([Artifact("k", old)])
    _ok(_sync_all([a, b]))
    shutil.copytree(a.root, tmp_path / "backup", symlinks=True)
    new = b.put(b"the new build" * 40)
    b.remember([Artifact("k", new)])
    a = _restored(a, tmp_path / "backup")
    _ok(_sync_all([a, b]))
    assert a.names()["k"] == new and b.names()["k"] == new and a.has(new)


def test_a_failed_read_of_the_whole_journal_fails_every_rank_alike(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = (ArtifactPool(tmp_path / n) for n in ("a", "b"))
    a.put(b"first build" * 40)
    _ok(_sync_all([a, b]))
    shutil.copytree(a.root, tmp_path / "backup", symlinks=True)
    b.put(b"built on b after the backup" * 40)
    _ok(_sync_all([a, b]))
    a = _restored(a, tmp_path / "backup")
    real = b.journal_since

    def failing(cursor: int = 0) -> tuple[list[str], int]:
        if cursor == 0:
            raise OSError("journal unreadable")
        return real(cursor)

    monkeypatch.setattr(b, "journal_since", failing)
    results = _sync_all([a, b])
    assert all(isinstance(x, PrefetchError) for x in results), results
    assert len({str(x) for x in results}) == 1 and "journal unreadable" in str(results[0])


def test_pools_synced_together_again_send_only_what_is_new_in_one_exchange(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = [ArtifactPool(tmp_path / f"p{r}") for r in range(3)]
    for r, pool in enumerate(pools):
        pool.put(f"rank {r} build".encode() * 40)
    _ok(_sync_all(pools))
    sent: list[list[str]] = []
    real = _sync.encode_gained
    monkeypatch.setattr(_sync, "encode_gained",
                        lambda shas, names: sent.append(list(shas)) or real(shas, names))
    news = pools[1].put(b"fetched lazily since" * 40)
    fresh = [ArtifactPool(p.root) for p in pools]  # a later job, no session state
    _ok(_sync_all(fresh))
    assert sorted(sent) == [[], [], [news]]
    assert all(p.has(news) for p in pools)


def test_cursors_kept_without_a_token_are_sent_whole_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = [ArtifactPool(tmp_path / f"p{r}") for r in range(2)]
    pools[0].put(b"first build" * 40)
    _ok(_sync_all(pools))
    for pool in pools:  # lines as a version without tokens kept them
        path = pool.layout.sync_cursor
        path.write_text("".join(" ".join(line.split(" ")[:3]) + "\n"
                                for line in path.read_text().splitlines()))
    sent: list[list[str]] = []
    real = _sync.encode_gained
    monkeypatch.setattr(_sync, "encode_gained",
                        lambda shas, names: sent.append(list(shas)) or real(shas, names))
    _ok(_sync_all(pools))
    assert len(sent) == 4 and sorted(map(len, sent)) == [0, 0, 1, 1]
    sent.clear()
    _ok(_sync_all(pools))
    assert sent == [[], []]


@pytest.mark.parametrize("gained", [b"", b"\x07", b"\x80" + bytes(40)],
                         ids=["empty", "short", "bad-flags"])
def test_a_journal_part_without_its_token_names_its_sender(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gained: bytes) -> None:
    pools = [ArtifactPool(tmp_path / f"p{r}") for r in range(2)]
    group = ThreadGroup(2, timeout=20)
    comms = [group.comm(r) for r in range(2)]
    real = type(comms[1]).allgather_object

    def shaped(self: object, obj: object, **kw: object) -> list[object]:
        if self is comms[1] and isinstance(obj, tuple) and len(obj) == 4:
            obj = (gained, *obj[1:])
        return real(self, obj, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(type(comms[1]), "allgather_object", shaped)
    results = on_threads(2, lambda r: sync(comm=comms[r], pool=pools[r]))
    assert all(isinstance(x, PrefetchError) for x in results), results
    assert len({str(x) for x in results}) == 1
    assert results[0].rank == 1  # type: ignore[union-attr]


# -- two jobs keeping cursors in one pool at once ---------------------------------------


def test_jobs_keeping_cursors_in_one_pool_at_once_keep_every_one(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    for i in range(3):
        pool.put(f"k{i}".encode() * 100)
    _, end = pool.journal_since(0)
    keys = [f"{i:016x}" for i in range(8)]
    lost = 0
    start = threading.Barrier(len(keys))

    def keeper(rank: int) -> None:
        start.wait()
        store_cursor(pool, end, key=keys[rank])

    for _ in range(25):
        pool.layout.sync_cursor.unlink(missing_ok=True)
        _ok(on_threads(len(keys), keeper))
        lost += any(stored_cursor(pool, k) != end for k in keys)
    assert lost == 0


def test_a_cursor_lock_held_too_long_skips_that_cursor_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"an object" * 50)
    _, end = pool.journal_since(0)
    monkeypatch.setattr(_cursors, "_LOCK_SECONDS", 0.05)
    other = FileLock(pool.layout.locks / "sync.cursor.lock", timeout=0)
    assert other.acquire() and other.held
    try:
        with caplog.at_level(logging.WARNING, logger="distcache"):
            store_cursor(pool, end, key="-")
        assert stored_cursor(pool, "-") == 0
        assert "cursor" in caplog.text
    finally:
        other.release()
    store_cursor(pool, end, key="-")
    assert stored_cursor(pool, "-") == end
