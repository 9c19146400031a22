"""What a peer's sync part names is checked where it is received: a label no pool may
record fails the sync in its sender's name before anything moves, alike on every
rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from distcache.collective import _sync, sync
from distcache.collective._sync import decode_gained, encode_gained
from distcache.comm import ThreadGroup
from distcache.errors import PrefetchError
from distcache.store._pool import ArtifactPool
from tests.support.helpers import on_threads


@pytest.mark.parametrize("name", ["../escape.cubin", "/etc/k.cubin", "a/./b", "dir/"])
def test_a_label_no_pool_may_record_is_a_value_error(name: str) -> None:
    sha = "ab" * 32
    with pytest.raises(ValueError):
        decode_gained(encode_gained([sha], {name: sha}))


def test_a_peers_unsafe_label_fails_the_sync_in_its_name_before_anything_moves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(3)]
    sha = pools[2].put(b"built on rank 2" * 40)
    real = _sync.encode_gained

    def forged(shas: list[str], names: dict[str, str]) -> bytes:
        return real(shas, {**names, "../escape.cubin": sha} if sha in shas else names)

    monkeypatch.setattr(_sync, "encode_gained", forged)
    group = ThreadGroup(3, timeout=20)
    results = on_threads(3, lambda r: sync(comm=group.comm(r), pool=pools[r]))
    assert all(isinstance(x, PrefetchError) for x in results), results
    assert len({str(x) for x in results}) == 1
    assert results[0].phase == "discover"
    assert results[0].rank == 2
    assert not pools[0].has(sha) and not pools[1].has(sha)
