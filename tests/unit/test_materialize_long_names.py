"""A file whose name takes (nearly) all 255 bytes a name may have is materialised like
any other: its temporary name keeps only the name's first bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from distcache.artifact import MAX_SEGMENT_BYTES, Artifact, sha256_hex
from distcache.store import ArtifactPool


@pytest.mark.parametrize("segment", [
    "k" * (MAX_SEGMENT_BYTES - len(".cubin")) + ".cubin",   # 255 ASCII bytes
    "é" * 120 + ".cubin",                                   # 246 bytes of UTF-8
])
def test_a_name_of_the_longest_segment_is_placed(tmp_path: Path, segment: str) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = b"kernel of a long name"
    artifact = Artifact(f"fmha/{segment}", sha256_hex(data))
    pool.put(data)
    placed = pool.materialize(artifact, tmp_path / "cubins")
    assert placed == tmp_path / "cubins" / "fmha" / segment
    assert placed.read_bytes() == data
    assert sorted(p.name for p in placed.parent.iterdir()) == [segment]  # no temporary left
