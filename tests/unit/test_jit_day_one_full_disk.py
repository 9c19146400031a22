"""A filesystem that refuses every write (full, over quota, read-only) stops a
materialisation with a :class:`JitCacheError` that names the family and the file and
keeps the errno; ``distcache prefetch --jit`` says so and exits 1. The full disk is
simulated: the write of each file fails with ``ENOSPC``."""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path
from typing import Any

import pytest

from distcache import jit
from distcache.cli import main
from distcache.errors import JitCacheError
from distcache.jit import _place
from distcache.store import ArtifactPool

FILES = {"fxgraph/ab/entry": b"graph", "ab/k.so": b"kernel" * 100}


def full_disk(*_args: Any) -> bool:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def seeded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pool holding the inductor family's files, and its directory emptied."""
    for var in ("DISTCACHE_POOL", "DISTCACHE_ORIGIN", "DISTCACHE_JIT_CACHES",
                "DISTCACHE_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # chosen again under this TMPDIR
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    built = tmp_path / "inductor"
    for rel, data in FILES.items():
        (built / rel).parent.mkdir(parents=True, exist_ok=True)
        (built / rel).write_bytes(data)
    jit.family("inductor", pool=ArtifactPool(tmp_path / "pool")).publish()
    for rel in FILES:
        (built / rel).unlink()
    return tmp_path


def test_a_full_disk_names_the_family_and_the_file(seeded: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_place, "_place", full_disk)
    family = jit.family("inductor", pool=ArtifactPool(seeded / "pool"))
    with pytest.raises(JitCacheError) as caught:
        family.materialize()
    exc = caught.value
    assert exc.family == "inductor" and exc.errno == errno.ENOSPC
    assert isinstance(exc, OSError)  # callers that catch OSError still do
    target = Path(exc.path)
    assert target.parent.is_dir() and target.relative_to(seeded / "inductor").as_posix() in FILES
    assert str(exc).startswith(f"inductor: cannot write {target} ")
    assert "No space left on device" in str(exc)


def test_prefetch_jit_on_a_full_disk_says_which_family_and_file(
        seeded: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_place, "_place", full_disk)
    capsys.readouterr()
    assert main(["prefetch", "--pool", str(seeded / "pool"), "--jit", "inductor"]) == 1
    err = capsys.readouterr().err
    # The package's error, in the command's words: the family and the file.
    assert f"distcache prefetch: inductor: cannot write {seeded / 'inductor'}/" in err
    assert "No space left on device" in err and "[Errno" not in err
