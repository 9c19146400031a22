"""What a node publishes is what it built: a file it only received from the pool is
not published again as its own (so an update another node publishes stays served), a
file still being written is left for a later publication, and the Inductor family
fills the directory torch itself uses."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

from distcache import jit
from distcache.artifact import sha256_hex
from distcache.jit import Family, FamilySpec, Root, _place
from distcache.jit._tools import inductor_default_dir
from distcache.store import ArtifactPool

KEY = "vllm=1;py=3.11;linux;dir=/cache"
X = "h/rank_0_0/model"


def node(root: Path, pool: ArtifactPool, who: str) -> Family:
    """One node's family: the same key (directory path) as every other node's."""
    return Family(FamilySpec("vllm", KEY, (Root(root),)), pool, publisher=who * 16)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a new file, as the engine writes it
    path.write_bytes(data)


def served(pool: ArtifactPool, path: str) -> str | None:
    entry = jit.union(jit.read_trees(pool, "vllm", KEY)).entries.get(path)
    return None if entry is None else entry.sha256


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file counts as written long before (a change time cannot be set back),
    so that publishing waits for none."""
    monkeypatch.setattr(_place, "settled", lambda st: True)


# -- a file received from the pool is not this node's work ---------------------------


@pytest.mark.usefixtures("quiet")
def test_a_node_does_not_publish_a_file_it_only_received_so_an_update_stays_served(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    v1, v2 = b"v1" * 100, b"v2 rewritten by a" * 10
    write(dir_a / X, v1)
    assert node(dir_a, pool, "a").publish() == 1
    assert node(dir_b, pool, "b").materialize().written == 1
    assert node(dir_b, pool, "b").publish() == 0
    # Node a's own rewrite: an update, served in place of v1.
    write(dir_a / X, v2)
    assert node(dir_a, pool, "a").publish() == 1
    assert served(pool, X) == sha256_hex(v2)
    # Node b keeps its copy of v1 (a file in place is never replaced) and built
    # nothing: it publishes nothing, in a new process or the one that placed it.
    b = node(dir_b, pool, "b")
    assert b.materialize().written == 0
    assert (dir_b / X).read_bytes() == v1
    assert b.publish() == 0 and b.publish() == 0
    merged = jit.union(jit.read_trees(pool, "vllm", KEY))
    assert merged.conflicts == {} and merged.entries[X].sha256 == sha256_hex(v2)
    # A fresh node is served the update.
    dir_c = tmp_path / "c"
    assert node(dir_c, pool, "c").materialize().written == 1
    assert (dir_c / X).read_bytes() == v2


@pytest.mark.usefixtures("quiet")
def test_bytes_a_node_built_itself_are_still_published_and_can_conflict(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    write(dir_a / X, b"built on a" * 30)
    write(dir_a / "h/k.so", b"kernel" * 40)
    assert node(dir_a, pool, "a").publish() == 2
    # Node b receives both, then its compile rewrites the model with bytes of its own:
    # two publishers, two digests, a conflict served from neither.
    b = node(dir_b, pool, "b")
    assert b.materialize().written == 2
    write(dir_b / X, b"built on b" * 30)
    assert b.publish() == 1
    merged = jit.union(jit.read_trees(pool, "vllm", KEY))
    assert set(merged.conflicts) == {X}
    assert merged.entries["h/k.so"].sha256 == sha256_hex(b"kernel" * 40)
    # A node that built a file no tree lists publishes it.
    write(dir_b / "h/new.so", b"new on b")
    assert b.publish() == 1
    assert served(pool, "h/new.so") == sha256_hex(b"new on b")


@pytest.mark.usefixtures("quiet")
def test_a_publisher_going_back_to_bytes_it_listed_before_updates_its_entry(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "a"
    old, new = b"first build" * 20, b"second build" * 20
    for data in (old, new, old):
        write(root / X, data)
        assert node(root, pool, "a").publish() == 1
        assert served(pool, X) == sha256_hex(data)


# -- a file still being written -------------------------------------------------------


@pytest.mark.usefixtures("quiet")
def test_a_file_rewritten_while_it_is_read_is_left_for_the_next_publication(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "a"
    write(root / "cached_ops/op/op.so", b"\x7fELF" + b"x" * 996)
    real = _place._read_all

    def read_while_the_linker_writes(fd: int, size: int) -> tuple[str, int]:
        data = real(fd, size)
        with open(root / "cached_ops/op/op.so", "ab") as f:
            f.write(b"y" * 9000)
        return data

    monkeypatch.setattr(_place, "_read_all", read_while_the_linker_writes)
    family = node(root, pool, "a")
    assert family.publish() == 0
    assert jit.read_trees(pool, "vllm", KEY) == []
    monkeypatch.setattr(_place, "_read_all", real)
    assert family.publish() == 1
    assert served(pool, "cached_ops/op/op.so") == sha256_hex(
        (root / "cached_ops/op/op.so").read_bytes())


def test_a_file_still_being_written_is_not_published_until_it_is_finished(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    a, b = tmp_path / "a", tmp_path / "b"
    target = a / "cached_ops/op/op.so"
    target.parent.mkdir(parents=True)
    (a / "cached_ops/op/build.ninja").write_bytes(b"rule cc\n")
    os.utime(a / "cached_ops/op/build.ninja", ns=(1, 1))
    stop = threading.Event()
    started = threading.Event()

    def link() -> None:
        # A linker writing its output in place, a little at a time, past the
        # publication below (which waits at most the racy window for it).
        with open(target, "wb") as f:
            f.write(b"\x7fELF")
            f.flush()
            started.set()
            deadline = time.monotonic() + _place.RACY_NS / 1e9 + 3
            while not stop.is_set() and time.monotonic() < deadline:
                f.write(b"x" * 100)
                f.flush()
                time.sleep(0.01)

    writer = threading.Thread(target=link)
    writer.start()
    try:
        started.wait(10)
        family = node(a, pool, "a")
        # build.ninja: old enough, published; op.so: still growing, left out.
        assert family.publish() == 1
        assert served(pool, "cached_ops/op/op.so") is None
    finally:
        stop.set()
        writer.join()
    # Finished: the next publication (a sync, or the one at exit, right after the
    # link) stores the whole file, and another node places all of it.
    assert family.publish() == 1
    whole = target.read_bytes()
    assert served(pool, "cached_ops/op/op.so") == sha256_hex(whole)
    node(b, pool, "b").materialize()
    assert (b / "cached_ops/op/op.so").read_bytes() == whole


def test_a_file_finished_just_before_a_publication_is_published_by_it(
        tmp_path: Path) -> None:
    # At exit there is no later publication: a file a compile finished a moment
    # before is published by this one.
    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "a"
    write(root / X, b"just built")
    began = time.monotonic()
    assert node(root, pool, "a").publish() == 1
    assert time.monotonic() - began < _place.RACY_NS / 1e9 + 5  # one wait, at most
    assert served(pool, X) == sha256_hex(b"just built")


# -- the Inductor directory is torch's ------------------------------------------------


def _user_dir(env: dict[str, str]) -> str:
    return inductor_default_dir(env).name


def test_inductor_skips_a_tmpdir_that_is_missing_or_not_a_directory_as_torch_does(
        tmp_path: Path) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    (tmp_path / "a-file").write_bytes(b"")
    for tmpdir in (tmp_path / "missing", tmp_path / "a-file"):
        env = {"TMPDIR": str(tmpdir), "TEMP": str(temp)}
        assert inductor_default_dir(env) == temp / _user_dir(env)
        family = jit.family("inductor", environ=env)
        assert family.materialize_dir() == temp / _user_dir(env)
        assert family.key.endswith(f";dir={temp / _user_dir(env)}")
    # The first writable one wins, TMPDIR before TEMP before TMP.
    env = {"TMPDIR": str(tmp_path), "TEMP": str(temp)}
    assert inductor_default_dir(env).parent == tmp_path
    env = {"TMP": str(temp), "TEMP": str(tmp_path / "missing")}
    assert inductor_default_dir(env).parent == temp


def test_inductor_follows_tempfile_for_this_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    monkeypatch.setenv("TEMP", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # computed again, as torch would
    expected = Path(tempfile.gettempdir())
    assert expected == tmp_path
    assert jit.family("inductor").materialize_dir() == expected / _user_dir(dict(os.environ))
    assert inductor_default_dir(dict(os.environ)).parent == expected


def test_inductor_takes_a_blank_cache_dir_as_the_working_directory_as_torch_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    family = jit.family("inductor", environ={"TORCHINDUCTOR_CACHE_DIR": "",
                                             "TMPDIR": str(tmp_path / "t")})
    assert family.materialize_dir() == tmp_path
    assert family.key.endswith(f";dir={tmp_path}")


def test_inductor_names_the_user_of_the_given_environment(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path), "LOGNAME": "ann/b:c", "USER": "other"}
    assert inductor_default_dir(env) == tmp_path / "torchinductor_ann_b_c"
