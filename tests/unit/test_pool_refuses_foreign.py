"""A directory that has ``objects/`` but neither ``format`` nor ``pool_id`` (another
tool's: a ``.git`` directory) is not opened as a pool by anything, the library included:
opening it would write a format, an identity and the pool's directories into it."""

from __future__ import annotations

from pathlib import Path

import pytest

import distcache
from distcache.errors import PoolError
from distcache.store import ArtifactPool
from tests.support.helpers import clear_settings


def _git_like(tmp_path: Path) -> Path:
    root = tmp_path / "repo.git"
    (root / "objects" / "ab").mkdir(parents=True)
    (root / "objects" / "ab" / ("c" * 38)).write_bytes(b"git object")
    (root / "HEAD").write_text("ref: refs/heads/main\n")
    return root


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def test_the_pool_refuses_another_tools_directory_unchanged(tmp_path: Path) -> None:
    # (Opened read-only, which writes nothing, its objects/ may still be read.)
    root = _git_like(tmp_path)
    before = _tree(root)
    with pytest.raises(PoolError, match="is not a distcache pool"):
        ArtifactPool(root)
    assert _tree(root) == before


def test_init_refuses_another_tools_directory_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)
    root = _git_like(tmp_path)
    before = _tree(root)
    monkeypatch.setenv("DISTCACHE_POOL", str(root))
    with pytest.raises(PoolError, match="is not a distcache pool"):
        distcache.init(manifests=[], integrations=[])
    assert _tree(root) == before


def test_a_pool_from_before_format_opens(tmp_path: Path) -> None:
    # A pool older than its format file has its pool_id: still a pool.
    root = tmp_path / "old"
    pool_id = ArtifactPool(root).pool_id
    (root / "format").unlink()
    assert ArtifactPool(root).pool_id == pool_id
    assert (root / "format").is_file()


@pytest.mark.parametrize("kind", ["file", "dangling-link", "link-to-file", "device"])
def test_a_pool_path_that_is_no_directory_says_what_is_there(tmp_path: Path,
                                                             kind: str) -> None:
    root = tmp_path / "pool"
    said = {"file": "a file", "dangling-link": "which does not exist",
            "link-to-file": "which is no directory", "device": "a device"}[kind]
    if kind == "file":
        root.write_text("not a pool\n")
    elif kind == "dangling-link":
        root.symlink_to(tmp_path / "missing" / "x")
    elif kind == "link-to-file":
        (tmp_path / "f").write_text("")
        root.symlink_to(tmp_path / "f")
    else:
        root = Path("/dev/null")
    with pytest.raises(PoolError) as raised:
        ArtifactPool(root)
    message = str(raised.value)
    assert f"cannot create pool root {root}: " in message, message
    assert said in message and "point DISTCACHE_POOL (or --pool) at a directory" in message
    assert "File exists" not in message, message
