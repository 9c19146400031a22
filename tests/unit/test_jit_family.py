"""Directory families in the pool: publish, materialise, conflicts, the owner check,
and materialising into a directory that a compile is writing at the same time."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from distcache import jit
from distcache.errors import ConfigError, JitCacheError
from distcache.jit import Family, FamilySpec, Root
from distcache.store import ArtifactPool


def spec(root: Path, key: str = "tool=1;py=3.11;linux", name: str = "inductor") -> FamilySpec:
    return FamilySpec(name, key, (Root(root),))


def fill(root: Path, files: dict[str, bytes], mode: int = 0o644) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


FILES = {"ab/cabc.cpp": b"int f() { return 1; }\n", "ab/cabc.so": b"\x7fELF" + b"\0" * 300,
         "fxgraph/xy/fxy/entry": b"graph" * 50, "top.py": b"print(1)\n"}


def test_a_published_directory_materialises_into_an_empty_one(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    fill(built, FILES)
    (built / "ab" / "cabc.so").chmod(0o755)
    assert Family(spec(built), pool).publish() == len(FILES)
    fresh = tmp_path / "fresh"
    placed = Family(spec(fresh), pool).materialize()
    assert (placed.written, placed.present, placed.kept, placed.missing) == (len(FILES), 0, 0, 0)
    for rel, data in FILES.items():
        assert (fresh / rel).read_bytes() == data
    assert (fresh / "ab" / "cabc.so").stat().st_mode & 0o777 == 0o755
    assert (fresh / "top.py").stat().st_mode & 0o777 == 0o644
    # Nothing new: a second publish lists no file and adds no tree.
    trees = len(jit.read_trees(pool, "inductor", spec(built).key))
    assert Family(spec(built), pool).publish() == 0
    assert len(jit.read_trees(pool, "inductor", spec(built).key)) == trees == 1
    # A second materialisation writes nothing.
    again = Family(spec(fresh), pool).materialize()
    assert (again.written, again.present) == (0, len(FILES))


def test_only_new_files_make_a_new_tree_and_other_keys_are_not_served(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    fill(built, {"a": b"one"})
    Family(spec(built), pool).publish()
    fill(built, {"b": b"two"})
    assert Family(spec(built), pool).publish() == 1
    trees = jit.read_trees(pool, "inductor", spec(built).key)
    assert sorted(len(t.entries) for t in trees) == [1, 1]
    other = tmp_path / "other"
    assert Family(spec(other, key="tool=2;py=3.11;linux"), pool).materialize().written == 0
    assert not other.exists() or list(other.iterdir()) == []
    assert Family(spec(other), pool).materialize().written == 2


def test_transient_files_are_not_published(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    fill(built, {"locks/x.lock": b"", "ab/c_CxxBuild/o.o": b"obj", ".c.py.123.tmp": b"half",
                 "tmp.pid_1_abc/k.cubin": b"half", "__pycache__/m.pyc": b"pyc", "keep.so": b"so"})
    Family(spec(built), pool).publish()
    (tree,) = jit.read_trees(pool, "inductor", spec(built).key)
    assert [e.path for e in tree.entries] == ["keep.so"]


def test_conflicting_bytes_at_one_path_are_served_from_neither(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    one, two = tmp_path / "rank0", tmp_path / "rank1"
    fill(one, {"same": b"same bytes", "graph.so": b"built by rank 0"})
    fill(two, {"same": b"same bytes", "graph.so": b"built by rank 1", "more": b"only one"})
    # Both ranks write one directory name's worth under one key.
    Family(spec(one), pool).publish()
    Family(spec(two), pool).publish()
    fresh = tmp_path / "fresh"
    family = Family(spec(fresh), pool)
    with caplog.at_level(logging.WARNING, logger="distcache.jit"):
        family.materialize()
        family.materialize()
    assert sorted(p.name for p in fresh.iterdir()) == ["more", "same"]
    assert family.report.conflicts == 0  # the second call logged nothing new
    warned = [r for r in caplog.records if "graph.so" in r.getMessage()]
    assert len(warned) == 1 and "not shared" in warned[0].getMessage()
    # A later publish of either version does not resolve the conflict.
    assert Family(spec(one), pool).publish() == 0
    assert not (fresh / "graph.so").exists()


def test_an_existing_file_is_never_replaced(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built, target = tmp_path / "built", tmp_path / "target"
    fill(built, FILES)
    Family(spec(built), pool).publish()
    fill(target, {"top.py": b"the compile's own version\n"})
    before = (target / "top.py").stat().st_ino
    placed = Family(spec(target), pool).materialize()
    assert (placed.written, placed.kept) == (len(FILES) - 1, 1)
    assert (target / "top.py").read_bytes() == b"the compile's own version\n"
    assert (target / "top.py").stat().st_ino == before


def test_a_corrupt_object_is_not_materialised(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    fill(built, {"kernel.so": b"good bytes" * 10, "other": b"fine"})
    Family(spec(built), pool).publish()
    (tree,) = jit.read_trees(pool, "inductor", spec(built).key)
    sha = next(e.sha256 for e in tree.entries if e.path == "kernel.so")
    obj = Path(pool.layout.object_path(sha))
    obj.chmod(0o644)
    obj.write_bytes(b"evil bytes" * 10)
    fresh = tmp_path / "fresh"
    placed = Family(spec(fresh), pool).materialize()
    assert (placed.written, placed.missing) == (1, 1)
    assert not (fresh / "kernel.so").exists()
    assert pool.quarantined == 1


def test_materialising_refuses_another_users_directory(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    fill(built, {"k.so": b"code"})
    Family(spec(built), pool).publish()
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 54321, 54321)
    else:  # a directory every system has that belongs to root
        theirs = Path("/")
    with pytest.raises(JitCacheError, match="belongs to uid"):
        Family(spec(theirs), pool).materialize()
    assert not (theirs / "k.so").exists()
    # At init the refusal is logged and recorded; the engine compiles as without us.
    family = Family(spec(theirs), pool)
    family.install(pool, None)
    assert family.report.refused is not None and "belongs to uid" in family.report.refused


def test_a_symbolic_link_inside_the_directory_is_not_written_through(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    fill(built, {"ab/k.so": b"code"})
    Family(spec(built), pool).publish()
    target, elsewhere = tmp_path / "target", tmp_path / "elsewhere"
    target.mkdir()
    elsewhere.mkdir()
    (target / "ab").symlink_to(elsewhere)
    placed = Family(spec(target), pool).materialize()  # the link keeps its place
    assert (placed.written, placed.kept) == (0, 1)
    assert list(elsewhere.iterdir()) == []


def _compile_writer(root: str, names: list[str], rounds: int) -> None:
    """A stand-in compile: writes its own version of each file the way Inductor and
    Triton do (temporary file, then os.replace), over and over."""
    Path(root, "started.marker").write_bytes(b"")
    for i in range(rounds):
        for name in names:
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{i}.tmp"
            with open(tmp, "wb") as f:
                f.write(b"compiled by the writer " + name.encode() * 100)
            os.replace(tmp, path)


def test_materialising_while_a_compile_writes_the_same_directory(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    files = {f"d{i % 7}/f{i}.so": (b"from the pool %d " % i) * 200 for i in range(120)}
    fill(built, files)
    Family(spec(built), pool).publish()
    target = tmp_path / "target"
    target.mkdir()
    contested = sorted(files)[::3]
    writer = multiprocessing.get_context("spawn").Process(
        target=_compile_writer, args=(str(target), contested, 20))
    writer.start()
    passes = 0
    try:
        while not (target / "started.marker").exists() and writer.is_alive():
            time.sleep(0.01)
        while writer.is_alive() or passes < 3:
            Family(spec(target), pool).materialize()
            passes += 1
    finally:
        writer.join(timeout=60)
    assert writer.exitcode == 0 and passes >= 3
    for rel, data in files.items():
        got = (target / rel).read_bytes()
        if rel in contested:
            # Whole files only: the pool's or the writer's, never a mix.
            assert got in (data, b"compiled by the writer " + rel.encode() * 100)
        else:
            assert got == data
    # Everything the writer did not write is present, and nothing temporary is left.
    leftovers = [p for p in target.rglob("*") if p.name.endswith(".distcache.tmp")]
    assert leftovers == []


def test_families_by_name_and_from_the_environment(tmp_path: Path) -> None:
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"), "TRITON_CACHE_DIR": str(tmp_path / "tr"),
           "DG_JIT_CACHE_DIR": str(tmp_path / "dg"), "VLLM_CACHE_ROOT": str(tmp_path / "v"),
           "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi"), "HOME": str(tmp_path)}
    found = jit.families(["inductor", "triton", "deep_gemm", "flashinfer_jit", "vllm",
                          "inductor"], environ=env)
    assert [f.name for f in found] == list(jit.NAMES)
    dirs = [f.materialize_dir() for f in found]
    assert dirs == [tmp_path / "ind", tmp_path / "tr", tmp_path / "dg",
                    tmp_path / "fi" / ".cache" / "flashinfer",
                    tmp_path / "v" / "torch_compile_cache"]
    # The key names what the files depend on: the tool, the Python, the directory.
    assert "torch=" in found[0].key and f"dir={tmp_path / 'ind'}" in found[0].key
    assert found[1].spec.environ == {"TRITON_CACHE_MANAGER": "distcache.jit._triton:PoolCacheManager"}
    with pytest.raises(ConfigError, match="unknown JIT cache 'nvcc'"):
        jit.family("nvcc")


def test_the_triton_family_sets_its_cache_manager_only_when_unset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    pool = ArtifactPool(tmp_path / "pool")
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    family = jit.family("triton", pool=pool, environ=env)
    family.install(pool, None)
    assert os.environ["TRITON_CACHE_MANAGER"] == "distcache.jit._triton:PoolCacheManager"
    family.uninstall()
    assert "TRITON_CACHE_MANAGER" not in os.environ
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "mine:Manager")
    family.install(pool, None)
    family.uninstall()
    assert os.environ["TRITON_CACHE_MANAGER"] == "mine:Manager"


def test_a_second_publish_rereads_only_files_that_changed(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    fill(built, {"a.so": b"first", "b.so": b"other"})
    family = Family(spec(built), pool)
    assert family.publish() == 2
    assert family.publish() == 0
    # Same size, new bytes and a new time: read again and published (an update of
    # this publisher's own file, not a conflict: test_jit_publisher.py).
    (built / "a.so").write_bytes(b"again")
    os.utime(built / "a.so", ns=(time.time_ns() + 10**9,) * 2)
    assert family.publish() == 1
    merged = jit.union(jit.read_trees(pool, "inductor", family.key))
    assert merged.conflicts == {} and merged.entries["a.so"].size == len(b"again")


def _materialise_in(pool_root: str, target: str, key: str) -> None:
    spec_ = FamilySpec("inductor", key, (Root(Path(target)),))
    Family(spec_, ArtifactPool(pool_root)).materialize()


def test_two_ranks_sharing_a_directory_materialise_it_at_once(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    files = {f"d{i % 5}/f{i}.so": (b"%d" % i) * 3000 for i in range(80)}
    fill(built, files)
    Family(spec(built), pool).publish()
    target = tmp_path / "shared"
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=_materialise_in,
                         args=(str(pool.root), str(target), spec(built).key)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=60)
    assert [r.exitcode for r in ranks] == [0, 0]
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == set(files)
    assert all((target / rel).read_bytes() == data for rel, data in files.items())
