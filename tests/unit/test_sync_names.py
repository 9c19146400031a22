"""Labels a pool records for bytes it already held reach the other pools at the next
sync: a cursor into ``names.log`` beside the journal's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective import SyncState, _sync, sync
from distcache.comm import ThreadGroup
from distcache.errors import PrefetchError
from distcache.store._pool import ArtifactPool
from distcache.store._prune import apply, plan_rm
from tests.support.helpers import on_threads


def _sync_all(pools: list[ArtifactPool], states: list[SyncState] | None = None) -> list[object]:
    group = ThreadGroup(len(pools), timeout=20)
    results = on_threads(len(pools), lambda r: sync(
        comm=group.comm(r), pool=pools[r], state=None if states is None else states[r]))
    return results


def _ok(results: list[object]) -> None:
    assert not any(isinstance(x, BaseException) for x in results), results


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """The labels every writer put into the exchange, one dict per encoding."""
    seen: list[dict[str, str]] = []
    real = _sync.encode_gained

    def spy(shas: list[str], names: dict[str, str]) -> bytes:
        seen.append(dict(names))
        return real(shas, names)

    monkeypatch.setattr(_sync, "encode_gained", spy)
    return seen


def _labels(sent: list[dict[str, str]]) -> dict[str, str]:
    return {n: s for names in sent for n, s in names.items()}


def _two_synced_pools(tmp_path: Path) -> tuple[list[ArtifactPool], str]:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    data = b"bytes every pool holds" * 40
    sha = pools[0].put(data)
    pools[0].remember([Artifact("cubins/first.cubin", sha)])
    _ok(_sync_all(pools))
    assert pools[1].names() == {"cubins/first.cubin": sha}
    return pools, sha


def test_a_label_for_bytes_already_held_reaches_the_other_pools(tmp_path: Path) -> None:
    pools, sha = _two_synced_pools(tmp_path)
    # A second name for the same bytes: the journal gains nothing.
    pools[0].remember([Artifact("cubins/alias.cubin", sha)])
    pools[1].remember([Artifact("cubins/other.cubin", sha)])
    _ok(_sync_all(pools))
    expected = {"cubins/first.cubin": sha, "cubins/alias.cubin": sha,
                "cubins/other.cubin": sha}
    assert pools[0].names() == expected
    assert pools[1].names() == expected


def test_a_label_brings_its_bytes_to_a_pool_that_lacks_them(tmp_path: Path) -> None:
    pools, _ = _two_synced_pools(tmp_path)
    data = b"held by pool 0 before any sync over a third pool" * 30
    sha = pools[0].put(data)
    _ok(_sync_all(pools))
    # Pool 1 loses the bytes; pool 0 then names them.
    os.unlink(pools[1].layout.object_path(sha))
    pools[0].remember([Artifact("cubins/late.cubin", sha)])
    _ok(_sync_all(pools))
    assert pools[1].names()["cubins/late.cubin"] == sha
    assert pools[1].get(sha) == data


def test_labels_are_not_sent_again(tmp_path: Path, sent: list[dict[str, str]]) -> None:
    pools, sha = _two_synced_pools(tmp_path)
    pools[0].remember([Artifact("cubins/alias.cubin", sha)])
    sent.clear()
    _ok(_sync_all(pools))
    assert _labels(sent) == {"cubins/alias.cubin": sha}
    # Pool 1 recorded the label it received; the next sync sends no label.
    sent.clear()
    _ok(_sync_all(pools))
    assert _labels(sent) == {}
    # Nor does a session's first sync, over pools opened afresh.
    sent.clear()
    fresh = [ArtifactPool(p.root) for p in pools]
    _ok(_sync_all(fresh, [SyncState(), SyncState()]))
    assert _labels(sent) == {}


def test_a_session_state_keeps_the_label_cursor_too(tmp_path: Path,
                                                     sent: list[dict[str, str]]) -> None:
    pools, sha = _two_synced_pools(tmp_path)
    states = [SyncState(), SyncState()]
    pools[1].remember([Artifact("cubins/alias.cubin", sha)])
    _ok(_sync_all(pools, states))
    assert pools[0].names()["cubins/alias.cubin"] == sha
    sent.clear()
    _ok(_sync_all(pools, states))
    assert _labels(sent) == {}


def test_a_names_log_rewritten_by_a_prune_is_sent_whole(tmp_path: Path,
                                                        sent: list[dict[str, str]]) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    one, two = (pools[0].put(f"object {i}".encode() * 50) for i in (1, 2))
    long = "cubins/" + "a-long-kernel-family-name/" * 4 + "last.cubin"
    pools[0].remember([Artifact("cubins/a.cubin", one), Artifact(long, two)])
    _ok(_sync_all(pools))
    assert pools[1].names()["cubins/a.cubin"] == one
    # "a" is relabelled and a label removed: the rewrite puts the new label where the
    # old one was, and leaves names.log as long as it was, its tail unchanged.
    size = pools[0].layout.names_log.stat().st_size
    pools[0].remember([Artifact("cubins/a.cubin", two), Artifact("cubins/gone.cubin", two)])
    apply(pools[0], plan_rm(pools[0], ["cubins/gone.cubin"]))
    assert pools[0].layout.names_log.stat().st_size == size
    sent.clear()
    _ok(_sync_all(pools))
    assert _labels(sent) == {"cubins/a.cubin": two, long: two}
    # Sent whole, and the only label for the name in this sync: every pool takes it.
    assert [p.names()["cubins/a.cubin"] for p in pools] == [two, two]


def test_a_label_sent_whole_never_reverts_a_newer_one(tmp_path: Path) -> None:
    pools, sha = _two_synced_pools(tmp_path)
    other = pools[1].put(b"a newer build" * 40)
    # Rank 1 relabels "first" (news since its cursor); rank 0 lost its cursors (a pool
    # restored from a backup, an upgrade) and sends its whole log, with the old label,
    # and a name of its own that rank 1 lacks.
    pools[1].remember([Artifact("cubins/first.cubin", other)])
    pools[0].remember([Artifact("cubins/only-here.cubin", sha)])
    pools[0].layout.sync_names_cursor.unlink()
    pools[0].layout.sync_cursor.unlink()
    _ok(_sync_all(pools))
    assert [p.names()["cubins/first.cubin"] for p in pools] == [other, other]
    assert pools[1].names()["cubins/only-here.cubin"] == sha
    assert pools[0].has(other)


def test_a_removed_names_log_is_sent_whole_as_it_grows_again(tmp_path: Path) -> None:
    pools, sha = _two_synced_pools(tmp_path)
    pools[0].layout.names_log.unlink()
    fresh = ArtifactPool(pools[0].root)
    fresh.remember([Artifact(f"cubins/renamed-{i}.cubin", sha) for i in range(4)])
    _ok(_sync_all([fresh, pools[1]]))
    assert all(pools[1].names().get(f"cubins/renamed-{i}.cubin") == sha for i in range(4))


def test_a_label_cursor_linked_elsewhere_is_not_followed(tmp_path: Path,
                                                         sent: list[dict[str, str]]) -> None:
    pools, sha = _two_synced_pools(tmp_path)
    cursor = pools[0].layout.sync_names_cursor
    elsewhere = tmp_path / "planted"
    os.replace(cursor, elsewhere)
    cursor.symlink_to(elsewhere)
    sent.clear()
    _ok(_sync_all(pools))
    # Without its cursor, pool 0 sends its labels whole, and keeps a cursor of its own.
    assert _labels(sent) == {"cubins/first.cubin": sha}
    assert not cursor.is_symlink() and elsewhere.read_text() != ""
    sent.clear()
    _ok(_sync_all(pools))
    assert _labels(sent) == {}


@pytest.mark.parametrize("payload", [b"\x07", "not bytes"], ids=["malformed", "not-bytes"])
def test_a_malformed_label_exchange_names_its_sender(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: object) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(3)]
    _ok(_sync_all(pools))
    data = b"held everywhere" * 30
    for pool in pools:
        pool.put(data)
    _ok(_sync_all(pools))
    pools[2].remember([Artifact("cubins/alias.cubin", sha256_hex(data))])
    real = _sync.encode_labels
    monkeypatch.setattr(_sync, "encode_labels",
                        lambda labels: payload if labels else real(labels))
    results = _sync_all(pools)
    assert all(isinstance(x, PrefetchError) for x in results), results
    errors = [x for x in results if isinstance(x, PrefetchError)]
    assert len({str(e) for e in errors}) == 1
    assert errors[0].phase == "discover"  # type: ignore[attr-defined]
    assert errors[0].rank == 2  # type: ignore[attr-defined]


def test_two_labels_sent_whole_end_as_one_in_every_pool(tmp_path: Path) -> None:
    # Two pools never synced, each with its own label for a name: neither is news, the
    # lowest rank's is kept everywhere, so the ranks resolve the name alike.
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    mine = [pool.put(f"build of rank {r}".encode() * 30) for r, pool in enumerate(pools)]
    for pool, sha in zip(pools, mine, strict=True):
        pool.remember([Artifact("cubins/k.cubin", sha)])
    _ok(_sync_all(pools))
    assert [p.names()["cubins/k.cubin"] for p in pools] == [mine[0], mine[0]]


def test_a_cursor_held_at_the_start_of_an_empty_log_makes_labels_news(tmp_path: Path) -> None:
    # Two empty pools synced (a serving loop's first safe point): their cursors sit at
    # offset 0 and hold. Labels recorded after are news on both sides and end alike.
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    _ok(_sync_all(pools))
    mine = [pool.put(f"build of rank {r}".encode() * 30) for r, pool in enumerate(pools)]
    for pool, sha in zip(pools, mine, strict=True):
        pool.remember([Artifact("cubins/k.cubin", sha)])
    _ok(_sync_all(pools))
    _ok(_sync_all(pools))
    assert [p.names()["cubins/k.cubin"] for p in pools] == [mine[0], mine[0]]


def test_news_beats_a_label_sent_whole_whatever_the_ranks(tmp_path: Path) -> None:
    # Rank 0 sends whole (its cursors gone) with the old label; rank 1 relabelled since
    # its cursor. The news wins though rank 0 is lower; a third pool follows it too.
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(3)]
    first = pools[0].put(b"first build" * 40)
    pools[0].remember([Artifact("cubins/k.cubin", first)])
    _ok(_sync_all(pools))
    newer = pools[1].put(b"newer build" * 40)
    pools[1].remember([Artifact("cubins/k.cubin", newer)])
    pools[0].layout.sync_names_cursor.unlink()
    pools[0].layout.sync_cursor.unlink()
    _ok(_sync_all(pools))
    assert [p.names()["cubins/k.cubin"] for p in pools] == [newer] * 3


@pytest.mark.parametrize("report", [
    ("one",), ("a", None, (True,), None), ["x"] * 5, (None, None, (True, True), "oops"),
    (None, None, (True, True), ("discover", None, 1)), (None, None, (True, True), 5)],
    ids=["short", "bad-flags", "long", "failure-text", "failure-short", "failure-number"])
def test_a_sync_report_of_another_shape_names_its_sender(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: tuple[object, ...]) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    _ok(_sync_all(pools))
    group = ThreadGroup(2, timeout=20)
    comms = [group.comm(r) for r in range(2)]
    real = type(comms[1]).allgather_object

    def shaped(self: object, obj: object, **kw: object) -> list[object]:
        if self is comms[1] and isinstance(obj, tuple) and len(obj) == 4:
            obj = report
        return real(self, obj, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(type(comms[1]), "allgather_object", shaped)
    results = on_threads(2, lambda r: sync(comm=comms[r], pool=pools[r]))
    assert all(isinstance(x, PrefetchError) for x in results), results
    assert len({str(x) for x in results}) == 1
    assert results[0].rank == 1  # type: ignore[union-attr]
    assert "sync report" in str(results[0])


def test_a_label_the_journal_lists_again_is_no_news(tmp_path: Path) -> None:
    # Rank 0's object is collected and put again: its journal lists it anew, with its
    # current label, recorded long ago. Rank 1's relabel since its cursor is the news.
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    data = b"first build" * 40
    first = pools[0].put(data)
    pools[0].remember([Artifact("k", first)])
    _ok(_sync_all(pools))
    pools[0].gc(0)
    pools[0].put(data)
    newer = pools[1].put(b"newer build" * 40)
    pools[1].remember([Artifact("k", newer)])
    _ok(_sync_all(pools))
    assert [p.names()["k"] for p in pools] == [newer, newer]


def test_the_winning_label_is_one_whose_bytes_some_pool_holds(tmp_path: Path) -> None:
    # Rank 0 labels k, then its bytes are collected before the sync; rank 1's label for
    # k has its bytes. Every pool ends with rank 1's, rank 2's included.
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(3)]
    _ok(_sync_all(pools))
    gone = pools[0].put(b"rank 0 build" * 40)
    pools[0].remember([Artifact("k", gone)])
    pools[0].gc(0)
    kept = pools[1].put(b"rank 1 build" * 40)
    pools[1].remember([Artifact("k", kept)])
    _ok(_sync_all(pools))
    assert [p.names().get("k") for p in pools] == [kept] * 3
    assert pools[2].has(kept)


def test_a_state_taken_over_other_pools_is_not_resumed(tmp_path: Path) -> None:
    a, b, c = (ArtifactPool(tmp_path / f"pool{i}") for i in range(3))
    sha = a.put(b"a build" * 40)
    a.remember([Artifact("k", sha)])
    state = SyncState()
    _ok(_sync_all([a, b], [state, SyncState()]))
    _ok(_sync_all([a, c], [state, SyncState()]))  # the same caller's state, other pools
    assert c.names().get("k") == sha and c.has(sha)


def test_a_state_cursor_without_its_mark_is_not_resumed(tmp_path: Path) -> None:
    a, b = (ArtifactPool(tmp_path / f"pool{i}") for i in range(2))
    sha = a.put(b"x" * 400)
    _, end = a.journal_since(0)
    state = SyncState(cursors={a.pool_id: end})  # no mark: nothing says it still holds
    _ok(_sync_all([a, b], [state, SyncState()]))
    assert b.has(sha)
