"""``Session.sync``'s publication of what the JIT caches gained is not collective: a
failure of one rank's, whatever its type, is logged there, and every rank still enters
the sync (none is left waiting for it)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from distcache import jit
from distcache._sync import publish_and_sync
from distcache.collective import SyncState
from distcache.comm import ThreadGroup
from distcache.store._pool import ArtifactPool
from tests.support.helpers import on_threads


class _Broken(jit.Family):
    def publish(self, pool: ArtifactPool | None = None) -> int:
        raise RuntimeError("a bug in a directory family")


def test_a_failed_publication_of_any_kind_leaves_no_rank_waiting(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    sha = pools[1].put(b"fetched lazily on rank 1" * 40)
    root = tmp_path / "cache"
    root.mkdir()
    broken = _Broken(jit.FamilySpec("inductor", "K", (jit.Root(root),)), pools[0])
    group = ThreadGroup(2, timeout=5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="distcache"):
        results = on_threads(2, lambda r: publish_and_sync(
            group.comm(r), pools[r], [broken] if r == 0 else [], SyncState(), 5))
    assert not any(isinstance(x, BaseException) for x in results), results
    assert time.monotonic() - started < 4
    assert pools[0].has(sha) and "a bug in a directory family" in caplog.text
