"""The pool's write-once files (``pool_id``, ``format``) where ``link(2)`` is refused,
and a copied pool's id renewed where file locks do not work."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from distcache.errors import PoolError
from distcache.store import _fs
from distcache.store._identity import PoolIdentity
from distcache.store._pool import ArtifactPool

#: Prepended to every child: link(2) refused, as on some FUSE and SMB mounts.
_NO_LINK = """
import errno, os, signal, sys, time
import distcache.store._fs as fs
def no_link(*args, **kwargs):
    raise OSError(errno.EPERM, "link refused")
os.link = no_link
"""


def _child(body: str, *args: str) -> subprocess.Popen[str]:
    script = _NO_LINK + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script, *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _refuse_links(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "link refused")

    monkeypatch.setattr(os, "link", no_link)


def _no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    """File locks unsupported, as on Lustre without ``-o flock`` or some FUSE/CIFS."""
    def enolck(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", enolck)


def _age(path: Path) -> None:
    """Make ``path`` look untouched for a day."""
    then = time.time() - 86400
    os.utime(path, (then, then))


def _killed_creator(root: Path, name: str) -> None:
    """A process opening a new pool at ``root``, killed right after its exclusive
    create of ``name`` and before its write."""
    child = _child("""
        real_open = os.open
        def open_then_die(path, flags, mode=0o777, **kwargs):
            fd = real_open(path, flags, mode, **kwargs)
            if os.path.basename(path) == sys.argv[2] and flags & os.O_EXCL:
                os.kill(os.getpid(), signal.SIGKILL)
            return fd
        os.open = open_then_die
        from distcache.store import ArtifactPool
        ArtifactPool(sys.argv[1])
    """, str(root), name)
    child.communicate(timeout=60)
    assert child.returncode == -9
    assert (root / name).stat().st_size == 0


# -- a write-once file left empty -----------------------------------------------------


@pytest.mark.parametrize("name", ["pool_id", "format"])
def test_a_file_left_empty_by_a_killed_creator_is_recreated_once_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    root = tmp_path / "p"
    _killed_creator(root, name)
    _age(root / name)
    _refuse_links(monkeypatch)
    pool = ArtifactPool(root)
    assert len(pool.pool_id) == 32
    assert (root / "pool_id").read_text().strip() == pool.pool_id
    assert (root / "format").read_text().strip() == str(pool.format_version)
    assert ArtifactPool(root).pool_id == pool.pool_id


def test_an_abandoned_file_is_recreated_where_file_locks_do_not_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "p"
    _killed_creator(root, "format")
    _age(root / "format")
    _refuse_links(monkeypatch)
    _no_flock(monkeypatch)
    pool = ArtifactPool(root)
    assert (root / "format").read_text().strip() == str(pool.format_version)
    assert ArtifactPool(root).pool_id == pool.pool_id


def test_an_empty_file_of_a_live_creator_is_waited_out_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "p"
    ArtifactPool(root)
    (root / "pool_id").write_bytes(b"")  # a creator between its create and its write
    monkeypatch.setattr(_fs, "EMPTY_WAIT_SECONDS", 0.05)
    with pytest.raises(PoolError, match="stays empty"):
        ArtifactPool(root)
    assert (root / "pool_id").exists()


def test_an_opener_waits_for_a_slow_creator_where_links_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over NFS another client's bytes show only at its close: the file stays empty
    # for as long as that client takes.
    root = tmp_path / "p"
    creator = _child("""
        real_write_all = fs.write_all
        def slow(fd, data):
            if os.readlink(f"/proc/self/fd/{fd}").endswith("/pool_id"):
                time.sleep(1.0)
            real_write_all(fd, data)
        fs.write_all = slow
        from distcache.store import ArtifactPool
        print(ArtifactPool(sys.argv[1]).pool_id)
    """, str(root))
    try:
        while not (root / "pool_id").exists() and creator.poll() is None:
            time.sleep(0.005)
        _refuse_links(monkeypatch)
        opened = ArtifactPool(root).pool_id
    finally:
        out, err = creator.communicate(timeout=60)
    assert creator.returncode == 0, err
    assert opened == out.strip() == (root / "pool_id").read_text().strip()


def test_processes_recreating_one_abandoned_pool_id_at_once_agree_on_one_id(
    tmp_path: Path
) -> None:
    root = tmp_path / "p"
    ArtifactPool(root)
    (root / "pool_id").write_bytes(b"")
    _age(root / "pool_id")
    gate = tmp_path / "gate"
    gate.mkdir()
    count = 4
    # Each one found the file abandoned before any of them goes on to replace it.
    body = """
        from distcache.store import ArtifactPool
        from distcache.store._locking import FileLock
        real_acquire = FileLock.acquire
        def gathered(self, *args, **kwargs):
            if "pool_id" in self.path:
                gate = sys.argv[2]
                open(os.path.join(gate, str(os.getpid())), "w").close()
                deadline = time.monotonic() + 20
                while len(os.listdir(gate)) < int(sys.argv[3]) and time.monotonic() < deadline:
                    time.sleep(0.005)
            return real_acquire(self, *args, **kwargs)
        FileLock.acquire = gathered
        print(ArtifactPool(sys.argv[1]).pool_id)
    """
    children = [_child(body, str(root), str(gate), str(count)) for _ in range(count)]
    results = [child.communicate(timeout=60) for child in children]
    for child, (_out, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err
    ids = {out.strip() for out, _err in results}
    assert ids == {(root / "pool_id").read_text().strip()}
    assert len(ids.pop()) == 32


# -- renewing a copied pool's id --------------------------------------------------------


def test_renew_keeps_the_id_where_file_locks_do_not_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = ArtifactPool(tmp_path / "p")
    before = pool.pool_id
    _no_flock(monkeypatch)
    with pytest.raises(PoolError, match="renew"):
        pool.identity.renew()
    assert pool.pool_id == before
    assert pool.layout.pool_id_file.read_text().strip() == before


def test_two_renewals_without_file_locks_leave_no_process_believing_another_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "p"
    a, b = ArtifactPool(root), ArtifactPool(root)
    _no_flock(monkeypatch)
    real_read = PoolIdentity._read

    def read_then_other_renews(self: PoolIdentity) -> str:
        text = real_read(self)
        if self is b.identity:
            with pytest.raises(PoolError):
                a.identity.renew()
        return text

    monkeypatch.setattr(PoolIdentity, "_read", read_then_other_renews)
    with pytest.raises(PoolError):
        b.identity.renew()
    on_disk = (root / "pool_id").read_text().strip()
    assert a.pool_id == b.pool_id == on_disk


def test_renew_returns_the_id_the_file_holds_after_its_replacement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "p"
    pool = ArtifactPool(root)
    before = pool.pool_id
    other = "ab" * 16
    real_replace = PoolIdentity._replace

    def replaced_then_overwritten(self: PoolIdentity, fresh: str) -> None:
        real_replace(self, fresh)
        (root / "elsewhere").write_text(f"{other}\n")  # a writer that took no lock
        os.replace(root / "elsewhere", root / "pool_id")

    monkeypatch.setattr(PoolIdentity, "_replace", replaced_then_overwritten)
    assert pool.identity.renew() == other
    assert pool.pool_id == other != before
