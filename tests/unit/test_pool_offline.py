"""``DISTCACHE_OFFLINE=1`` at the pool: an origin passed to it directly is not asked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.errors import ConfigError
from distcache.origins import HttpOrigin
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[LoopbackOrigin, list[Artifact]]]:
    artifacts = make_artifacts(tmp_path / "origin", 2, min_size=100, max_size=500)
    with LoopbackOrigin(tmp_path / "origin") as srv:
        yield srv, artifacts


def test_offline_fetch_and_download_with_an_explicit_origin_make_no_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    served: tuple[LoopbackOrigin, list[Artifact]],
) -> None:
    srv, (first, second) = served
    pool = ArtifactPool(tmp_path / "pool")
    origin = HttpOrigin(srv.url, retries=0)
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    for call in (pool.fetch, pool.download):
        with pytest.raises(ConfigError) as caught:
            call(first, origin)
        message = str(caught.value)
        assert first.name in message and first.sha256 in message
        assert srv.url in message and "DISTCACHE_OFFLINE=1" in message
        assert "distcache fetch --manifest" in message and "distcache pool import" in message
        assert caught.value.variable == "DISTCACHE_OFFLINE"  # type: ignore[attr-defined]
    assert srv.total_requests == 0
    assert not pool.has(first.sha256)
    assert list((tmp_path / "pool").rglob("*.lock")) == []

    # What the pool holds is still served offline; the setting is read at each call.
    monkeypatch.delenv("DISTCACHE_OFFLINE")
    data = pool.fetch(first, origin)
    assert srv.total_requests == 1
    monkeypatch.setenv("DISTCACHE_OFFLINE", "1")
    assert pool.fetch(first, origin) == data
    with pytest.raises(ConfigError, match=second.name):
        pool.fetch(second, origin)
    assert srv.total_requests == 1
