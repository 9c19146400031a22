"""A label cursor left behind the journal cursor (not kept: its lock held too long, a
process stopped between keeping the two) says less than the sync it stayed behind
knew: what it resends was delivered, and must not revert a label recorded since."""

from __future__ import annotations

from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.collective import _cursors, _sync, sync
from distcache.comm import ThreadGroup
from distcache.store._pool import ArtifactPool
from tests.support.helpers import on_threads


def _sync_all(pools: list[ArtifactPool]) -> None:
    group = ThreadGroup(len(pools), timeout=20)
    results = on_threads(len(pools), lambda r: sync(comm=group.comm(r), pool=pools[r]))
    assert not any(isinstance(x, BaseException) for x in results), results


def test_a_label_cursor_not_kept_never_reverts_a_newer_label(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = (ArtifactPool(tmp_path / n) for n in ("a", "b"))
    _sync_all([a, b])  # cursors held on both sides
    old = a.put(b"the old build" * 40)
    a.remember([Artifact("cubins/k.cubin", old)])
    real = _cursors.store_labels_cursor

    def not_in_a(pool: ArtifactPool, *args: object) -> None:
        if pool.root != a.root:  # pool a's names cursor is not kept this once
            real(pool, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_sync, "store_labels_cursor", not_in_a)
    _sync_all([a, b])
    monkeypatch.undo()
    assert b.names()["cubins/k.cubin"] == old
    new = b.put(b"the new build" * 40)
    b.remember([Artifact("cubins/k.cubin", new)])
    _sync_all([a, b])
    assert [p.names()["cubins/k.cubin"] for p in (a, b)] == [new, new]
