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


def _published(tmp_path: Path) -> tuple[ArtifactPool, str, str]:
    """A pool, the sha of an object it just published, and that object's path."""
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"kernel bytes")
    return pool, sha, pool.layout.object_path(sha)


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
    pool, sha, path = _published(tmp_path)
    before = os.stat(path)
    os.chmod(path, 0o644)
    Path(path).write_bytes(b"kernel bytez")  # same size, same inode
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert pool.get(sha, trust_own=True) is None
    assert hashed and pool.quarantined == 1
    assert sha not in pool.verified()


def test_a_file_put_in_the_objects_place_is_another_inode_and_is_hashed(
        tmp_path: Path, hashed: list[int]) -> None:
    pool, sha, path = _published(tmp_path)
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
    member.vouch({shas[1]: (seen[0], seen[1], seen[2], seen[3] + 1, seen[4])})
    assert member.get(shas[1], trust_own=True) == b"kernel 1"
    assert len(hashed) == 2


def test_a_file_on_a_reused_inode_with_the_old_mtime_and_size_is_hashed(
        tmp_path: Path, hashed: list[int]) -> None:
    # Delete the object, write other bytes of its size (likely on its freed inode
    # number), give them its mtime and rename them into place: the ctime moved.
    pool, sha, path = _published(tmp_path)
    before = os.stat(path)
    os.unlink(path)
    planted = Path(path + ".planted")
    planted.write_bytes(b"kernel bytez")
    os.utime(planted, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.rename(planted, path)
    assert pool.get(sha, trust_own=True) is None
    assert len(hashed) == 1 and pool.quarantined == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_file_of_another_user_is_hashed_even_when_its_witness_matches(
        tmp_path: Path, hashed: list[int]) -> None:
    pool, sha, path = _published(tmp_path)
    os.chown(path, 12345, -1)
    pool.vouch({sha: _objects.witness(os.stat(path))})  # matches, but not this user's
    assert pool.get(sha, trust_own=True) == b"kernel bytes"
    assert len(hashed) == 1


def test_where_links_are_refused_a_published_object_is_not_trusted(
        tmp_path: Path, hashed: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # A rename stands in for link(2) (FUSE, SMB), whose inode numbers may be made up.
    import errno

    def refused(*_: object, **__: object) -> None:
        raise OSError(errno.EPERM, "links refused here")

    monkeypatch.setattr(os, "link", refused)
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"kernel bytes")
    assert pool.verified() == {}
    assert pool.get(sha, trust_own=True) == b"kernel bytes"
    assert len(hashed) == 1


def test_a_recency_stamp_keeps_the_stamping_process_trusting(
        tmp_path: Path, hashed: list[int]) -> None:
    pool, sha, path = _published(tmp_path)
    old = os.stat(path).st_mtime_ns - 3_600 * 10**9
    os.utime(path, ns=(old, old))  # an hour old: the next read stamps it
    seen = {sha: _objects.witness(os.stat(path))}  # as if verified an hour ago
    pool.vouch(seen)
    other = ArtifactPool(tmp_path / "pool")
    other.vouch(seen)
    assert pool.get(sha, trust_own=True) == b"kernel bytes"  # stamps, still trusted
    assert os.stat(path).st_mtime_ns > old and hashed == []
    assert pool.get(sha, trust_own=True) == b"kernel bytes"
    assert hashed == []
    # Another process's witness predates the stamp: it hashes.
    assert other.get(sha, trust_own=True) == b"kernel bytes"
    assert len(hashed) == 1



def test_a_member_takes_only_well_formed_witnesses_of_files_changed_in_this_prefetch(
        caplog: pytest.LogCaptureFixture) -> None:
    import time

    from distcache import _delegate

    began = time.time_ns()
    new = (b"\x01" * 32, 1, 2, 3, 4, began + 10)
    coarse = (b"\x02" * 32, 1, 2, 3, 4, began - 10**8)  # file times lag the clock
    older = (b"\x03" * 32, 1, 2, 3, 4, began - 5 * 10**9)  # e.g. torn in an old job
    assert _delegate._vouched([new, coarse, older], began) == {
        "01" * 32: (1, 2, 3, 4, began + 10), "02" * 32: (1, 2, 3, 4, began - 10**8)}
    assert caplog.text == ""
    # Malformed: nothing is trusted, and the rank carries on (it only hashes).
    assert _delegate._vouched([new, (b"\x04", 1)], began) == {}
    assert _delegate._vouched("not a list", began) == {}
    assert "malformed" in caplog.text
