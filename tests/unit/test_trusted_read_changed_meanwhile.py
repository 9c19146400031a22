"""A read that skips hashing (the object was verified in this job and its file is
unchanged) is trusted only if the file stayed unchanged while it was read: bytes
written in place meanwhile are hashed, found wrong and never served, and the
recency stamp of that read does not carry the trust over to the changed file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from distcache.store import ArtifactPool, _objects, _reading

DATA = bytes(range(256)) * 4096


def _written_during_the_read(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The next read of an object has its file written in place, same size, while it
    is read (as root may, or its owner after a chmod)."""
    real = _reading.read_fd

    def read_fd(fd: int, size: int) -> Any:
        os.chmod(path, 0o644)
        with open(path, "r+b") as f:
            f.seek(size - 4096)
            f.write(b"\0" * 4096)
        os.chmod(path, 0o444)
        monkeypatch.setattr(_reading, "read_fd", real)
        return real(fd, size)

    monkeypatch.setattr(_reading, "read_fd", read_fd)


@pytest.mark.parametrize("stamp_due", [False, True])
def test_bytes_changed_while_read_are_hashed_and_never_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stamp_due: bool) -> None:
    if stamp_due:  # as for an object published more than the stamp interval ago
        monkeypatch.setattr(_objects.ObjectStore, "stamp_interval", 0.0)
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(DATA)  # verified by this process: a trusted read skips the hash
    assert pool.get(sha, trust_own=True) == DATA
    _written_during_the_read(monkeypatch, str(pool.layout.object_path(sha)))
    got = pool.get(sha, trust_own=True)
    assert got is None or hashlib.sha256(got).hexdigest() == sha
    assert got is None and any(  # found corrupt: quarantined, not served
        entry.name.startswith(sha) for entry in pool.layout.quarantine.iterdir())
    for _ in range(2):  # nor later, from a witness taken of the changed file
        again = pool.get(sha, trust_own=True)
        assert again is None or hashlib.sha256(again).hexdigest() == sha
