"""The incremental sync's edges: the cursor a pool keeps, the journal it points into,
and what writers exchange."""

from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective import SyncState, _sync, sync
from distcache.collective._cursors import store_cursor, stored_cursor
from distcache.collective._sync import decode_gained
from distcache.comm import ThreadGroup
from distcache.errors import PrefetchError
from distcache.store._pool import ArtifactPool
from tests.support.helpers import on_threads


def _sync_all(pools: list[ArtifactPool], states: list[SyncState] | None = None) -> list[object]:
    group = ThreadGroup(len(pools), timeout=20)
    return on_threads(len(pools), lambda r: sync(
        comm=group.comm(r), pool=pools[r], state=None if states is None else states[r]))


def _blobs(count: int, tag: str) -> list[bytes]:
    return [f"{tag} kernel {i}".encode() * 50 for i in range(count)]


# -- reading and keeping the cursor --------------------------------------------------


def test_a_fifo_planted_as_the_cursor_does_not_hang_the_sync(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    fifo = pool.layout.sync_cursor
    os.mkfifo(fifo)
    out: list[object] = []
    reader = threading.Thread(target=lambda: out.append(stored_cursor(pool)), daemon=True)
    reader.start()
    reader.join(5)
    hung = reader.is_alive()
    if hung:  # release the blocked open so the thread ends
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        reader.join(5)
    assert not hung, "reading the cursor blocked on a FIFO"
    assert out == [0]


def test_a_cursor_linked_elsewhere_is_not_followed(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    for blob in _blobs(3, "a"):
        pool.put(blob)
    _, end = pool.journal_since(0)
    store_cursor(pool, end)
    assert stored_cursor(pool) == end
    elsewhere = tmp_path / "planted"
    os.replace(pool.layout.sync_cursor, elsewhere)
    pool.layout.sync_cursor.symlink_to(elsewhere)
    assert stored_cursor(pool) == 0


def test_a_cursor_of_absurd_length_reads_as_none_instead_of_failing(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.layout.sync_cursor.write_text("9" * 5000 + "\n")
    assert stored_cursor(pool) == 0


def test_storing_the_cursor_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    for blob in _blobs(2, "b"):
        pool.put(blob)
    _, end = pool.journal_since(0)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    cursor = pool.layout.sync_cursor
    planted = cursor.with_name(f".{cursor.name}.{os.getpid()}.{threading.get_ident()}")
    planted.symlink_to(victim)
    store_cursor(pool, end)
    assert victim.read_text() == "precious\n"
    assert not cursor.is_symlink()
    assert stored_cursor(pool) == end


def test_a_stored_cursor_is_readable_by_the_pools_other_users(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"one object")
    _, end = pool.journal_since(0)
    old = os.umask(0o002)
    try:
        store_cursor(pool, end)
    finally:
        os.umask(old)
    assert pool.layout.sync_cursor.stat().st_mode & 0o777 == 0o664


# -- a cursor must point into the journal it was taken from ---------------------------


def test_a_replaced_journal_is_synced_whole_not_from_the_old_offset(tmp_path: Path) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    for blob in _blobs(3, "before"):
        pools[0].put(blob)
    assert not any(isinstance(x, BaseException) for x in _sync_all(pools))
    # The journal is removed (or the pool restored from elsewhere) and grows past
    # the old cursor before the next sync.
    pools[0].layout.journal_log.unlink()
    after = _blobs(5, "after")
    for blob in after:
        pools[0].put(blob)
    results = _sync_all(pools)
    assert not any(isinstance(x, BaseException) for x in results), results
    missing = [i for i, blob in enumerate(after) if not pools[1].has(sha256_hex(blob))]
    assert missing == []


def test_a_session_cursor_into_a_replaced_journal_is_not_trusted(tmp_path: Path) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    states = [SyncState() for _ in pools]
    for blob in _blobs(3, "before"):
        pools[0].put(blob)
    assert not any(isinstance(x, BaseException) for x in _sync_all(pools, states))
    pools[0].layout.journal_log.unlink()
    after = _blobs(5, "after")
    for blob in after:
        pools[0].put(blob)
    results = _sync_all(pools, states)
    assert not any(isinstance(x, BaseException) for x in results), results
    assert all(pools[1].has(sha256_hex(blob)) for blob in after)


def test_an_unchanged_journal_is_not_sent_again(tmp_path: Path) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    data = b"lazily fetched" * 40
    art = Artifact("cubins/lazy.cubin", sha256_hex(data))
    pools[0].put(data, art.sha256)
    pools[0].remember([art])
    _sync_all(pools)
    assert pools[1].names() == {art.name: art.sha256}
    # What pool 1 received is journaled there, yet every pool of the sync holds it:
    # the next sync lists nothing again.
    reports = _sync_all(pools)
    assert reports[0].objects == 0  # type: ignore[attr-defined]
    # A lazy fetch after that is listed (the cursor did not pass it).
    later = b"fetched after the sync" * 40
    pools[1].put(later)
    reports = _sync_all(pools)
    assert reports[0].objects == 1 and pools[0].has(sha256_hex(later))  # type: ignore[attr-defined]


# -- what writers exchange ------------------------------------------------------------


def _blob(count: int, digests: bytes, text: bytes) -> bytes:
    return struct.pack("<I", count) + digests + zlib.compress(text)


@pytest.mark.parametrize("blob", [
    b"\x01\x00",  # cut short before the count ends
    _blob(1, bytes(32), b"1 a.cubin"),  # an index past the digests
    _blob(2, bytes(64), b"-1 a.cubin"),  # a negative index
    _blob(1, bytes(32), b"0"),  # a label without a name
    struct.pack("<I", 1) + bytes(32) + b"not zlib",
    _blob(1, bytes(32), b"0 \xff\xfe.cubin"),  # not UTF-8
], ids=["cut-short", "index-past-end", "negative-index", "no-name", "not-zlib", "not-utf8"])
def test_a_malformed_exchange_is_a_value_error(blob: bytes) -> None:
    with pytest.raises(ValueError):
        decode_gained(blob)


def test_a_malformed_exchange_fails_every_rank_with_the_same_prefetch_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(3)]
    pools[1].put(b"gained")
    monkeypatch.setattr(_sync, "encode_gained", lambda shas, names: b"\x07")
    results = _sync_all(pools)
    assert all(isinstance(x, PrefetchError) for x in results), results
    errors = [x for x in results if isinstance(x, PrefetchError)]
    assert len({str(e) for e in errors}) == 1 and errors[0].phase == "discover"


# -- a pool synced by several jobs ----------------------------------------------------


def test_a_sync_over_other_pools_does_not_advance_this_jobs_cursor(tmp_path: Path) -> None:
    shared, mine, theirs = (tmp_path / n for n in ("shared", "mine", "theirs"))
    data = b"fetched lazily into the shared pool" * 20
    ArtifactPool(shared).put(data)
    # Another job over the same shared pool and a pool of its own syncs first.
    _sync_all([ArtifactPool(shared), ArtifactPool(theirs)])
    assert ArtifactPool(theirs).has(sha256_hex(data))
    results = _sync_all([ArtifactPool(shared), ArtifactPool(mine)])
    assert not any(isinstance(x, BaseException) for x in results), results
    assert ArtifactPool(mine).has(sha256_hex(data))
    # Each job's cursor is its own: a further sync of either moves nothing.
    for other in (theirs, mine):
        again = _sync_all([ArtifactPool(shared), ArtifactPool(other)])
        assert again[0].broadcasts == 0  # type: ignore[attr-defined]


# -- reading a long journal -------------------------------------------------------------


def test_reading_a_long_journal_holds_a_chunk_not_the_whole_file(tmp_path: Path) -> None:
    import tracemalloc

    pool = ArtifactPool(tmp_path / "pool")
    shas = [sha256_hex(b"gc'd and fetched again"), sha256_hex(b"and again")]
    # Objects collected and fetched again are journaled again: a long-lived pool's
    # journal holds far more records than objects.
    with open(pool.layout.journal_log, "wb") as f:
        f.write(b"".join(f"\n{s}\n".encode() for s in shas) * 20_000)
        f.write(b"\n" + b"x" * 200_000 + b"\n")  # a damaged stretch, no record in it
        f.write(f"\n{shas[0]}".encode())  # a torn last record
    size = pool.layout.journal_log.stat().st_size
    tracemalloc.start()
    try:
        found, cursor = pool.journal_since(0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == shas and cursor == size - 64
    assert peak < 1_000_000, f"{peak} bytes held to read a {size}-byte journal"
    assert pool.journal_since(cursor) == ([], cursor)
    assert pool.journal_since(size - 30) == ([], size - 30)  # mid-record: nothing complete
