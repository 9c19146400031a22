"""A pool is made only in a new or empty directory, or where a pool was begun.

Every open that can write sweeps ``tmp/`` and ``locks/`` of files an hour old. Given a
directory that is not a pool (a project directory passed as ``--pool``), the first
command made it one and deleted the owner's ``tmp/notes.txt`` and ``locks/deploy.lock``
without a word. Such a directory is now refused, naming what it holds; an empty one,
one holding only a file system's ``lost+found`` or hidden entries, and one a creator
stopped part-way through are made pools as before (the guards).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from distcache import ArtifactPool
from distcache.errors import PoolError
from distcache.store.layout import FORMAT_VERSION


def _old(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    hours_ago = time.time() - 2 * 3600
    os.utime(path, (hours_ago, hours_ago))


def test_a_directory_holding_other_files_is_not_made_a_pool(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _old(project / "tmp" / "notes.txt", "my notes")
    _old(project / "locks" / "deploy.lock", "owner=alice")
    (project / "src").mkdir()
    with pytest.raises(PoolError, match="not a distcache pool") as caught:
        ArtifactPool(project)
    assert "'src'" in str(caught.value) and str(project) in str(caught.value)
    assert (project / "tmp" / "notes.txt").read_text() == "my notes"
    assert (project / "locks" / "deploy.lock").read_text() == "owner=alice"
    assert not (project / "objects").exists() and not (project / "format").exists()


def test_the_message_shows_a_few_of_many_names(tmp_path: Path) -> None:
    for name in ("a", "b", "c", "d", "e"):
        (tmp_path / "many" / name).mkdir(parents=True)
    with pytest.raises(PoolError, match=r"\('a', 'b', 'c', \.\.\.\)"):
        ArtifactPool(tmp_path / "many")


@pytest.mark.parametrize("present", [(), ("lost+found", ".hidden"), ("format", "tmp")])
def test_an_empty_or_begun_directory_is_made_a_pool(tmp_path: Path,
                                                    present: tuple[str, ...]) -> None:
    root = tmp_path / "pool"
    root.mkdir()
    for name in present:
        if name == "format":
            (root / name).write_text(f"{FORMAT_VERSION}\n")  # stopped before objects/
        else:
            (root / name).mkdir()
    pool = ArtifactPool(root)
    sha = pool.put(b"bytes")
    assert pool.get(sha) == b"bytes"
    assert ArtifactPool(root).pool_id == pool.pool_id  # and it opens again
