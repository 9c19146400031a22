"""The command line carries JIT cache families: ``pool ls --family``, ``pool export
--family`` and ``import``, and ``prefetch --jit``."""

from __future__ import annotations

import json
import tarfile
import tempfile
from pathlib import Path

import pytest

from distcache import jit
from distcache.cli import main
from distcache.store import ArtifactPool

FILES = {"fxgraph/ab/entry": b"graph", "ab/k.so": b"kernel" * 100}


@pytest.fixture
def seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("DISTCACHE_POOL", "DISTCACHE_ORIGIN", "DISTCACHE_JIT_CACHES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    # tempfile keeps the directory it chose first for the process (as torch gets it):
    # this test's process chooses again.
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    built = tmp_path / "inductor"
    for rel, data in FILES.items():
        (built / rel).parent.mkdir(parents=True, exist_ok=True)
        (built / rel).write_bytes(data)
    pool = ArtifactPool(tmp_path / "pool")
    jit.family("inductor", pool=pool).publish()
    return tmp_path


def ls_families(pool: Path, capsys: pytest.CaptureFixture[str], *name: str) -> list[dict]:
    capsys.readouterr()
    assert main(["pool", "--pool", str(pool), "ls", "--family", *name, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["families"]


def test_pool_ls_lists_each_family_and_key(seeded: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (found,) = ls_families(seeded / "pool", capsys)
    assert (found["family"], found["files"], found["trees"], found["conflicts"]) == (
        "inductor", 2, 1, 0)
    assert found["bytes"] == sum(map(len, FILES.values()))
    assert found["key"] == jit.family("inductor").key
    assert ls_families(seeded / "pool", capsys, "triton") == []
    assert main(["pool", "--pool", str(seeded / "pool"), "ls", "--family"]) == 0
    assert "inductor" in capsys.readouterr().out


def test_export_of_a_family_and_import_elsewhere(seeded: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    pool = ArtifactPool(seeded / "pool")
    pool.put(b"not a family member")
    target = seeded / "inductor.tar"
    assert main(["pool", "--pool", str(pool.root), "export", "--family", "inductor",
                 "--tar", str(target)]) == 0
    with tarfile.open(target) as tar:
        names = [m.name for m in tar.getmembers()]
    assert names[0] == "checksums.txt"
    assert all(n.startswith("jit/inductor/") for n in names[1:]) and len(names) == 4
    assert main(["pool", "--pool", str(seeded / "site"), "import", str(target)]) == 0
    (found,) = ls_families(seeded / "site", capsys)
    assert (found["family"], found["files"], found["absent"]) == ("inductor", 2, 0)


def test_prefetch_jit_fills_the_cache_directory(seeded: Path) -> None:
    built = seeded / "inductor"
    for rel in FILES:
        (built / rel).unlink()
    assert main(["prefetch", "--pool", str(seeded / "pool"), "--jit", "inductor"]) == 0
    for rel, data in FILES.items():
        assert (built / rel).read_bytes() == data
    assert main(["prefetch", "--pool", str(seeded / "pool"), "--jit", "nvcc"]) == 2
    assert main(["prefetch", "--pool", str(seeded / "pool"), "--jit", "inductor",
                 "--dry-run"]) == 2
