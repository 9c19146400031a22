"""An import whose objects another process collects before its names are recorded
fails instead of reporting success.

``pool gc --max-bytes 1`` from another process during an import removed objects the
import had published; it then recorded every name and reported all imported, while
``pool ls`` listed only what was left. The objects are now checked before the names
are recorded: none is recorded, and the error says to run the import again, which
then completes (the guard).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from distcache.errors import PoolError
from distcache.store import ArtifactPool
from distcache.store._import import import_set
from distcache.testing import make_artifacts
from tests.support.helpers import clear_settings


def test_objects_collected_during_an_import_fail_it_and_a_rerun_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    clear_settings(monkeypatch)
    served = make_artifacts(tmp_path / "set", 4, min_size=100, max_size=300, seed=9)
    pool = ArtifactPool(tmp_path / "pool")
    real_put = ArtifactPool.put
    puts: list[str] = []

    def put_then_collect(self: ArtifactPool, data: Any, sha: str | None = None) -> str:
        made = real_put(self, data, sha)
        puts.append(made)
        if len(puts) == 3:  # another process's gc removes the first object published
            os.unlink(self.layout.object_path(puts[0]))
        return made

    monkeypatch.setattr(ArtifactPool, "put", put_then_collect)
    with pytest.raises(PoolError, match=r"removed from the pool .* run the import again"):
        import_set(pool, tmp_path / "set", None, None)
    assert pool.names() == {}
    monkeypatch.setattr(ArtifactPool, "put", real_put)
    report = import_set(pool, tmp_path / "set", None, None)
    assert report.new_objects == 1
    assert sorted(pool.names()) == sorted(a.name for a in served)
