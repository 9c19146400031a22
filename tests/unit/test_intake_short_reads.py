"""A fetch reads the staged download back whole, however short each read comes back.

Linux returns at most 0x7ffff000 bytes from one ``pread``, whatever it is asked: an
artifact over 2 GiB read back in one call was cut short, hashed, and refused as the
origin's corruption. The cap is simulated here, so small files take the same path.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from distcache import Artifact, ArtifactPool, DirOrigin
from distcache.store._intake import pread_all

CAP = 1000  # bytes one pread returns at most, here (the kernel's is about 2 GiB)


@pytest.fixture
def capped_pread(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """os.pread returning at most CAP bytes a call; the sizes asked, in order."""
    real = os.pread
    asked: list[int] = []

    def pread(fd: int, n: int, offset: int) -> bytes:
        asked.append(n)
        return real(fd, min(n, CAP), offset)

    monkeypatch.setattr(os, "pread", pread)
    return asked


def _mirror(tmp_path: Path, data: bytes) -> tuple[DirOrigin, Artifact]:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "big.cubin").write_bytes(data)
    return DirOrigin(mirror), Artifact("big.cubin", hashlib.sha256(data).hexdigest())


def test_fetch_reads_a_staged_download_back_whole(tmp_path: Path,
                                                  capped_pread: list[int]) -> None:
    data = os.urandom(10 * CAP + 123)
    origin, artifact = _mirror(tmp_path, data)
    pool = ArtifactPool(tmp_path / "pool")
    assert pool.fetch(artifact, origin) == data
    assert pool.has(artifact.sha256)
    assert pool.get(artifact.sha256) == data
    assert len(capped_pread) > 1  # the read back did come back short


def test_pread_all_reads_to_the_size_or_the_end(tmp_path: Path,
                                                capped_pread: list[int]) -> None:
    data = os.urandom(3 * CAP + 1)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_all(fd, len(data)) == data
        assert pread_all(fd, 2 * CAP + 7) == data[: 2 * CAP + 7]
        assert pread_all(fd, len(data) + 5000) == data  # the file ends first
        assert pread_all(fd, 0) == b""
    finally:
        os.close(fd)
