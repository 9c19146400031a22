"""Exports and imports that must leave things whole: an exported file is no door into
the pool, a failed or interrupted ``pool export DIR`` leaves DIR as it was, a tarball is
never written inside the pool, a command refused for its input creates no pool, and an
interrupted import leaves no object that no name reaches."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from distcache.artifact import parse_checksums
from distcache.store import ArtifactPool
from distcache.store._export import export_directory
from distcache.store._fs import process_umask
from distcache.store._objects import ObjectStore
from tests.support.cli import cli_env, run_cli
from tests.support.helpers import clear_settings


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return cli_env(tmp_path)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _set(root: Path, files: dict[str, bytes]) -> Path:
    """A directory holding ``files`` and the checksums.txt that lists them."""
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "checksums.txt").write_text("".join(f"{_sha(d)}  {n}\n" for n, d in files.items()))
    return root


def _pool(env: dict[str, str], root: Path, source: Path) -> Path:
    done = run_cli(env, "--pool", str(root), "pool", "import", str(source))
    assert done.returncode == 0, done.stderr
    return root


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: a file's bytes, None for a directory."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def _object(pool: Path, data: bytes) -> Path:
    sha = _sha(data)
    return pool / "objects" / sha[:2] / sha


def _corrupt(path: Path) -> None:
    os.chmod(path, 0o644)
    with open(path, "ab") as out:
        out.write(b"bit rot\n")


def _objects(pool: Path) -> set[str]:
    return {p.name for p in (pool / "objects").rglob("*") if p.is_file()}


def _stop_at(call: int, real: Callable[..., object]) -> Callable[..., object]:
    """``real``, but the ``call``-th call raises KeyboardInterrupt, as Ctrl-C there would."""
    calls = [0]

    def stopping(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return stopping


FIRST = {"a/x.bin": b"first x\n", "b.bin": b"shared b\n"}
SECOND = {"a/x.bin": b"second x\n", "b.bin": b"shared b\n"}
MANY = {f"k/{i:02d}.cubin": f"kernel {i}\n".encode() * 40 for i in range(20)}


# --- A: an exported file is a copy -----------------------------------------------------


def test_an_exported_file_shares_no_inode_with_the_pool_and_writing_it_leaves_the_pool_whole(
    tmp_path: Path, env: dict[str, str]
) -> None:
    pool = _pool(env, tmp_path / "pool", _set(tmp_path / "src", FIRST))
    out = tmp_path / "mirror"
    done = run_cli(env, "--pool", str(pool), "pool", "export", str(out))
    assert done.returncode == 0, done.stderr
    for name, data in FIRST.items():
        exported, obj = (out / name).stat(), _object(pool, data).stat()
        assert (exported.st_dev, exported.st_ino) != (obj.st_dev, obj.st_ino)
        assert exported.st_nlink == 1 and obj.st_nlink == 1
        assert stat.S_IMODE(exported.st_mode) == 0o444 & ~process_umask()
    _corrupt(out / "b.bin")
    assert _object(pool, FIRST["b.bin"]).read_bytes() == FIRST["b.bin"]
    report = ArtifactPool(pool).verify()
    assert report.corrupt == 0 and report.ok == 2


# --- B: pool export DIR is all or nothing ----------------------------------------------


def test_a_failed_export_over_an_earlier_one_leaves_it_as_it_was(
    tmp_path: Path, env: dict[str, str]
) -> None:
    first = _pool(env, tmp_path / "first", _set(tmp_path / "src1", FIRST))
    second = _pool(env, tmp_path / "second", _set(tmp_path / "src2", SECOND))
    out = tmp_path / "out" / "mirror"
    assert run_cli(env, "--pool", str(first), "pool", "export", str(out)).returncode == 0
    before = _tree(out)
    # a/x.bin sorts first and differs; b.bin's object then fails verification.
    _corrupt(_object(second, SECOND["b.bin"]))
    done = run_cli(env, "--pool", str(second), "pool", "export", str(out))
    assert done.returncode == 1, done.stdout
    assert "b.bin" in done.stderr and "is corrupt" in done.stderr
    assert "not in the pool" not in done.stderr and "fetch it first" not in done.stderr
    assert _tree(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["mirror"]
    # The mirror still imports: checksums.txt and the files agree.
    done = run_cli(env, "--pool", str(tmp_path / "fresh"), "pool", "import", str(out))
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("earlier", [False, True])
def test_an_interrupted_export_leaves_the_directory_as_it_was(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, earlier: bool
) -> None:
    pool = _pool(env, tmp_path / "pool", _set(tmp_path / "src", MANY))
    artifacts = parse_checksums((tmp_path / "src" / "checksums.txt").read_text())
    out = tmp_path / "out" / "mirror"
    out.parent.mkdir()
    if earlier:
        export_directory(ArtifactPool(pool), artifacts[:3], out)
    before = _tree(out) if earlier else None
    monkeypatch.setattr(ObjectStore, "read", _stop_at(5, ObjectStore.read))
    with pytest.raises(KeyboardInterrupt):
        export_directory(ArtifactPool(pool), artifacts, out)
    if earlier:
        assert _tree(out) == before
        assert sorted(p.name for p in out.parent.iterdir()) == ["mirror"]
    else:
        assert list(out.parent.iterdir()) == []


def test_an_export_merges_into_an_earlier_one_and_swaps_it_whole(
    tmp_path: Path, env: dict[str, str]
) -> None:
    first = _pool(env, tmp_path / "first", _set(tmp_path / "src1", FIRST))
    second = _pool(env, tmp_path / "second", _set(tmp_path / "src2", {"c.bin": b"c\n"}))
    out = tmp_path / "mirror"
    assert run_cli(env, "--pool", str(first), "pool", "export", str(out)).returncode == 0
    done = run_cli(env, "--pool", str(second), "pool", "export", str(out))
    assert done.returncode == 0, done.stderr
    listed = {a.name: a.sha256 for a in parse_checksums((out / "checksums.txt").read_text())}
    assert listed == {n: _sha(d) for n, d in {**FIRST, "c.bin": b"c\n"}.items()}
    assert all(_sha((out / n).read_bytes()) == s for n, s in listed.items())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mirror")]


@pytest.mark.parametrize("stray", ["notes.txt", "a/unlisted.bin"])
def test_an_export_over_what_no_export_wrote_is_refused_untouched(
    tmp_path: Path, env: dict[str, str], stray: str
) -> None:
    pool = _pool(env, tmp_path / "pool", _set(tmp_path / "src", FIRST))
    out = tmp_path / "mirror"
    if stray == "notes.txt":
        out.mkdir()
    else:
        assert run_cli(env, "--pool", str(pool), "pool", "export", str(out)).returncode == 0
    (out / stray).write_text("someone else's\n")
    before = _tree(out)
    done = run_cli(env, "--pool", str(pool), "pool", "export", str(out))
    assert done.returncode == 1, done.stdout
    assert "cannot export to" in done.stderr and "Traceback" not in done.stderr
    assert _tree(out) == before


# --- C: no tarball inside the pool -----------------------------------------------------


@pytest.mark.parametrize("where", ["tmp/out.tar", "objects/out.tar", "out.tar"])
def test_a_tarball_inside_the_pool_is_refused(
    tmp_path: Path, env: dict[str, str], where: str
) -> None:
    pool = _pool(env, tmp_path / "pool", _set(tmp_path / "src", FIRST))
    done = run_cli(env, "--pool", str(pool), "pool", "export", "--tar", str(pool / where))
    assert done.returncode == 1, done.stdout
    assert "inside the pool" in done.stderr
    assert not (pool / where).exists()
    assert not [p for p in (pool / "tmp").iterdir() if "out.tar" in p.name]


# --- D: no pool for a refused input ----------------------------------------------------


@pytest.mark.parametrize("command", [
    ["prefetch", "--manifest", "MISSING"],
    ["prefetch", "--manifest", "LISTED", "--origin", "NOWHERE"],
    ["pool", "import", "MISSING.tar"],
])
def test_a_command_refused_for_its_input_creates_no_pool(
    tmp_path: Path, env: dict[str, str], command: list[str]
) -> None:
    listed = _set(tmp_path / "src", FIRST) / "checksums.txt"
    places = {"MISSING": str(tmp_path / "missing.txt"), "LISTED": str(listed),
              "NOWHERE": str(tmp_path / "nonexistent"),
              "MISSING.tar": str(tmp_path / "missing.tar")}
    new = tmp_path / "new-pool"
    done = run_cli(env, "--pool", str(new), *(places.get(a, a) for a in command))
    assert done.returncode == 1, done.stdout + done.stderr
    assert not new.exists()


# --- E: an interrupted or failed import takes back what it added -----------------------


def _two_pools(env: dict[str, str], tmp_path: Path) -> tuple[Path, Path]:
    """A pool of :data:`FIRST` and one of another artifact, ``c.bin``."""
    return (_pool(env, tmp_path / "first", _set(tmp_path / "src1", FIRST)),
            _pool(env, tmp_path / "second", _set(tmp_path / "src2", {"c.bin": b"c\n"})))


def _holds_both(out: Path) -> None:
    """``out`` is an export of both pools' artifacts, whole, with no leftover."""
    listed = {a.name: a.sha256 for a in parse_checksums((out / "checksums.txt").read_text())}
    assert listed == {n: _sha(d) for n, d in {**FIRST, "c.bin": b"c\n"}.items()}
    assert all(_sha((out / n).read_bytes()) == s for n, s in listed.items())
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("why", ["mount point", "parent not writable"])
def test_an_export_into_a_directory_it_cannot_replace_is_written_inside_it(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    # A mount point (a USB drive's root, an NFS share) cannot be renamed over, and a
    # directory whose parent this user cannot write cannot be swapped: the export is
    # built inside it and put in place there, the earlier export carried over.
    from distcache.store import _mirror

    first, second = _two_pools(env, tmp_path)
    out = tmp_path / "usb"
    export_directory(ArtifactPool(first),
                     parse_checksums((tmp_path / "src1" / "checksums.txt").read_text()), out)
    if why == "mount point":
        monkeypatch.setattr(_mirror.os.path, "ismount", lambda p: Path(p) == out)
    else:
        real = os.access
        monkeypatch.setattr(_mirror.os, "access",
                            lambda p, m: False if Path(p) == out.parent else real(p, m))
    monkeypatch.setattr(_mirror.os, "rename", lambda *a: pytest.fail(f"renamed {a}"))
    inode = os.stat(out).st_ino
    export_directory(ArtifactPool(second),
                     parse_checksums((tmp_path / "src2" / "checksums.txt").read_text()), out)
    assert os.stat(out).st_ino == inode  # the same directory, written inside
    _holds_both(out)


@pytest.mark.parametrize("cwd", [".", "a"], ids=["dot", "inside-it"])
def test_an_export_into_the_working_directory_leaves_the_shell_in_it(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, cwd: str
) -> None:
    # ``pool export .`` (or into a directory that holds the shell's): swapped in by a
    # rename, the shell would be left in a removed directory that lists empty, and a
    # second export from it would fail. It is written inside the directory instead.
    first, second = _two_pools(env, tmp_path)
    out = tmp_path / "here"
    out.mkdir()
    if cwd != ".":
        done = run_cli(env, "--pool", str(first), "pool", "export", str(out))
        assert done.returncode == 0, done.stderr
    monkeypatch.chdir(out / cwd)
    inode = os.stat(".").st_ino
    for pool in (first, second):
        done = run_cli(env, "--pool", str(pool), "pool", "export",
                       "." if cwd == "." else str(out))
        assert done.returncode == 0, done.stderr
        assert os.stat(".").st_nlink > 0 and os.stat(".").st_ino == inode
        assert os.stat(out / cwd).st_ino == inode  # the shell's directory is in the export
    _holds_both(out)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("listed", [True, False], ids=["with-checksums", "loose"])
def test_an_import_of_the_directory_that_holds_the_pool_is_refused_alike_each_time(
    tmp_path: Path, env: dict[str, str], listed: bool
) -> None:
    # The pool kept inside the set: its own files would be imported as artifacts
    # (pool/format, pool/pool_id), and the next import refused as a pool's archive.
    source = tmp_path / "set"
    if listed:
        _set(source, FIRST)
    else:
        for name, data in FIRST.items():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes(data)
    pool = source / ".pool"
    before = _tree(source)
    for _ in range(2):
        done = run_cli(env, "--pool", str(pool), "pool", "import", str(source))
        assert done.returncode == 1, done.stdout
        assert f"the pool {pool} is inside it" in done.stderr, done.stderr
        assert _tree(source) == before  # no pool made there


def test_a_tarball_export_onto_a_directory_is_refused_before_writing(
    tmp_path: Path, env: dict[str, str]
) -> None:
    pool = _pool(env, tmp_path / "pool", _set(tmp_path / "src", FIRST))
    target = tmp_path / "out.tar"
    target.mkdir()
    done = run_cli(env, "--pool", str(pool), "pool", "export", "--tar", str(target))
    assert done.returncode == 1, done.stdout
    assert f"cannot export to {target}: it is a directory" in done.stderr, done.stderr
    assert ".tmp" not in done.stderr and "Errno" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.tar", "pool", "src"]
