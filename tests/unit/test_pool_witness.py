"""Verified once per job: an object this process verified (published it, or took a
node leader's word for it) is read without hashing while its file is unchanged, and
hashed as before once it is not, or when the reader does not ask for trust."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.store import ArtifactPool, _objects


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the object reads that hash their bytes."""
    calls: list[int] = []
    real = _objects.sha256_hex

    def counting(data: bytes | bytearray | memoryview) -> str:
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(_objects, "sha256_hex", counting)
    yield calls


def test_an_object_this_pool_published_is_read_unhashed_when_trust_is_asked(
        tmp_path: Path, hashed: list[int]) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"kernel bytes")
    assert pool.get(sha, trust_own=True) == b"kernel bytes"
    assert hashed == []
    assert pool.get(sha) == b"kernel bytes"  # a plain read always hashes
    assert hashed == [len(b"kernel bytes")]
    assert set(pool.verified()) == {sha}


def test_an_object_changed_in_place_is_hashed_and_quarantined(
        tmp_path: Path, hashed: list[int]) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"kernel bytes")
    path = pool.layout.object_path(sha)
    before = os.stat(path)
    os.chmod(path, 0o644)
    Path(path).write_bytes(b"kernel bytez")  # same size, same inode
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert pool.get(sha, trust_own=True) is None
    assert hashed and pool.quarantined == 1
    assert sha not in pool.verified()


def test_a_file_put_in_the_objects_place_is_another_inode_and_is_hashed(
        tmp_path: Path, hashed: list[int]) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"kernel bytes")
    path = pool.layout.object_path(sha)
    planted = tmp_path / "planted"
    planted.write_bytes(b"kernel bytez")
    mtime = os.stat(path).st_mtime_ns
    os.utime(planted, ns=(mtime, mtime))
    os.replace(planted, path)
    assert pool.get(sha, trust_own=True) is None
    assert len(hashed) == 1 and pool.quarantined == 1


def test_another_process_trusts_what_it_was_vouched_for_while_the_file_matches(
        tmp_path: Path, hashed: list[int]) -> None:
    leader = ArtifactPool(tmp_path / "pool")
    shas = [leader.put(f"kernel {i}".encode()) for i in range(3)]
    member = ArtifactPool(tmp_path / "pool")
    assert member.get(shas[0], trust_own=True) == b"kernel 0"
    assert len(hashed) == 1  # not vouched for: hashed
    member.vouch(leader.verified())
    assert [member.get(s, trust_own=True) for s in shas] == [b"kernel 0", b"kernel 1",
                                                              b"kernel 2"]
    assert len(hashed) == 1
    # A witness that does not match the file (another mtime) is no reason to trust.
    seen = leader.verified()[shas[1]]
    member.vouch({shas[1]: (seen[0], seen[1], seen[2], seen[3] + 1)})
    assert member.get(shas[1], trust_own=True) == b"kernel 1"
    assert len(hashed) == 2
