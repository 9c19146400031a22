"""JIT families against what a node meets: malformed or oversized tree objects, a
cache directory that cannot be filled, a stale file where a tree has a directory, a
symbolic link as the cache directory, headers on a node that has none yet, and
Triton's manager serving the session's pool."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from distcache import jit
from distcache.artifact import Artifact
from distcache.errors import JitCacheError
from distcache.jit import Family, FamilySpec, Root
from distcache.jit._tools import inductor_default_dir
from distcache.jit._tree import MAX_TREE_BYTES, TreeManifest, tree_label
from distcache.store import ArtifactPool

KEY = "tool=1;py=3.11;linux"
FILES = {"aa/k1.so": b"\x7fELF" + b"1" * 200, "m": b"meta",
         "zz/k2.so": b"\x7fELF" + b"2" * 200, "zz/k3.so": b"\x7fELF" + b"3" * 200}


def _built(tmp_path: Path) -> ArtifactPool:
    """A pool holding one published tree of FILES (the inductor family, KEY)."""
    pool = ArtifactPool(tmp_path / "pool")
    built = tmp_path / "built"
    for rel, data in FILES.items():
        (built / rel).parent.mkdir(parents=True, exist_ok=True)
        (built / rel).write_bytes(data)
    assert Family(FamilySpec("inductor", KEY, (Root(built),)), pool).publish() == len(FILES)
    return pool


def _label_tree(pool: ArtifactPool, data: bytes) -> None:
    sha = pool.put(data)
    pool.remember([Artifact(tree_label("inductor", KEY, sha), sha, len(data))])


@pytest.mark.parametrize("doc", [b"[]", b"null", b"7", b"[" * 100_000 + b"]" * 100_000,
                                 b'{"version": 2, "family": "inductor", "key": "k", '
                                 b'"publisher": "0123456789abcdef", "seq": 1, '
                                 b'"files": [[7, "x", 0, 0]]}'])
def test_a_malformed_tree_object_is_ignored_not_raised(tmp_path: Path, doc: bytes,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    pool = _built(tmp_path)
    with pytest.raises(JitCacheError, match="malformed tree manifest"):
        TreeManifest.decode(doc)
    _label_tree(pool, doc)
    fresh = tmp_path / "fresh"
    family = Family(FamilySpec("inductor", KEY, (Root(fresh),)), pool)
    with caplog.at_level(logging.WARNING, logger="distcache"):
        placed = family.materialize()
    # The good tree is served; the bad one is named in a warning and skipped.
    assert placed.written == len(FILES)
    assert any("ignoring tree" in r.getMessage() for r in caplog.records)
    assert len(jit.summarize(pool)) == 1
    # What the prefetch moves: every blob and both tree labels (a pool passes on what
    # it holds; each reader decodes, and skips, the bad one itself).
    assert len(family.manifest()) == len(FILES) + 2


def test_a_tree_label_naming_a_large_object_is_skipped_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = _built(tmp_path)
    _label_tree(pool, b"x" * 4096)
    monkeypatch.setattr("distcache.jit._tree.MAX_TREE_BYTES", 1024)
    read: list[str] = []
    real_get = pool.get

    def counting_get(sha: str, **kwargs: bool) -> bytes | None:
        read.append(sha)
        return real_get(sha, **kwargs)

    monkeypatch.setattr(pool, "get", counting_get)
    trees = jit.read_trees(pool, "inductor", KEY)
    assert len(trees) == 1 and MAX_TREE_BYTES > 1024
    big = next(s for n, s in pool.names().items() if n.startswith("jit/")
               and "/tree/" in n and s not in {t for t in read})
    assert big not in read  # its size ruled it out before any read
    assert len(jit.summarize(pool)) == 1 and big not in read


@pytest.mark.parametrize("blocker", ["file", "dangling-link"])
def test_a_cache_directory_that_cannot_be_created_is_logged_not_raised(
    tmp_path: Path, blocker: str, caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _built(tmp_path)
    cache = tmp_path / "cache"
    if blocker == "file":
        cache.write_bytes(b"not a directory")
    else:
        cache.symlink_to(tmp_path / "nowhere")
    family = Family(FamilySpec("inductor", KEY, (Root(cache),), {"SOME_TOOL_VAR": "1"}),
                    pool)
    try:
        with caplog.at_level(logging.WARNING, logger="distcache"):
            family.install(pool, None)  # the engine goes on and compiles
        assert family.report.refused is not None
        assert any("was not filled from the pool" in r.getMessage() for r in caplog.records)
        assert os.environ["SOME_TOOL_VAR"] == "1"  # installed all the same
    finally:
        family.uninstall()
    assert "SOME_TOOL_VAR" not in os.environ


def test_a_file_where_the_tree_has_a_directory_keeps_its_place_and_the_rest_is_placed(
    tmp_path: Path,
) -> None:
    pool = _built(tmp_path)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "aa").write_bytes(b"stale")  # where the tree has the directory aa/
    placed = Family(FamilySpec("inductor", KEY, (Root(fresh),)), pool).materialize()
    assert (placed.written, placed.kept) == (len(FILES) - 1, 1)
    assert (fresh / "aa").read_bytes() == b"stale"
    for rel in ("m", "zz/k2.so", "zz/k3.so"):
        assert (fresh / rel).read_bytes() == FILES[rel]


def test_a_cache_directory_that_is_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    pool = _built(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "cache"
    link.symlink_to(real)
    family = Family(FamilySpec("inductor", KEY, (Root(link),)), pool)
    with pytest.raises(JitCacheError, match="symbolic link"):
        family.materialize()
    assert list(real.iterdir()) == []  # nothing written through it
    family.install(pool, None)  # at start-up: logged, the engine compiles
    assert family.report.refused is not None and "symbolic link" in family.report.refused
    assert list(real.iterdir()) == []


def test_precompiled_headers_go_to_torchs_default_folder_on_a_node_without_one(
    tmp_path: Path,
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    tmp_a, tmp_b = tmp_path / "tmp-a", tmp_path / "tmp-b"
    tmp_a.mkdir()
    tmp_b.mkdir()  # a TMPDIR that is missing is skipped, by torch as by distcache
    env_a = {"TMPDIR": str(tmp_a), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env_b = {**env_a, "TMPDIR": str(tmp_b)}
    default_a = inductor_default_dir(env_a)
    (default_a / "precompiled_headers").mkdir(parents=True)
    (default_a / "precompiled_headers" / "h.gch").write_bytes(b"pch")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "k.so").write_bytes(b"kernel")
    a = jit.family("inductor", pool=pool, environ=env_a)
    assert a.publish() == 2
    # Another node: the same key, and no precompiled_headers folder yet.
    (tmp_path / "cache" / "k.so").unlink()
    b = jit.family("inductor", pool=pool, environ=env_b)
    assert b.key == a.key
    placed = b.materialize()
    assert placed.written == 2
    default_b = inductor_default_dir(env_b)
    assert (default_b / "precompiled_headers" / "h.gch").read_bytes() == b"pch"
    assert not (tmp_path / "cache" / "precompiled_headers@default").exists()


def test_the_triton_family_points_its_cache_manager_at_the_installed_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DISTCACHE_POOL", raising=False)
    monkeypatch.delenv("TRITON_CACHE_MANAGER", raising=False)
    pool = ArtifactPool(tmp_path / "given-pool")
    family = jit.family("triton", pool=pool, environ={"TRITON_CACHE_DIR": str(tmp_path / "t")})
    family.install(pool, None)
    try:
        assert os.environ["DISTCACHE_POOL"] == str(pool.root)
    finally:
        family.uninstall()
    assert "DISTCACHE_POOL" not in os.environ
    # A pool the user named for the process is theirs: kept.
    monkeypatch.setenv("DISTCACHE_POOL", str(tmp_path / "theirs"))
    family.install(pool, None)
    family.uninstall()
    assert os.environ["DISTCACHE_POOL"] == str(tmp_path / "theirs")


def test_an_integration_that_fails_unexpectedly_on_one_rank_fails_every_rank_at_once(
    tmp_path: Path,
) -> None:
    import threading

    from distcache._resolve import prefetch_manifests
    from distcache.comm import ThreadGroup
    from distcache.errors import RemoteError

    class Broken(Family):
        def manifest(self) -> list[Artifact]:
            raise AttributeError("'NoneType' object has no attribute 'get'")  # a defect

    pools = [ArtifactPool(tmp_path / f"pool-{n}") for n in "ab"]
    group = ThreadGroup(2, ["node-a", "node-b"], timeout=60)
    out: list[object] = [None, None]
    took = [0.0, 0.0]

    def body(rank: int) -> None:
        began = time.monotonic()
        family = Family if rank == 1 else Broken
        try:
            out[rank] = prefetch_manifests(
                group.comm(rank), pools[rank], None, timeout=60,
                integrations=[family(FamilySpec("inductor", KEY, (Root(tmp_path / "c"),)),
                                     pools[rank])])
        except BaseException as exc:
            out[rank] = exc
        took[rank] = time.monotonic() - began

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert isinstance(out[0], AttributeError)  # its own error, as it was
    assert isinstance(out[1], RemoteError) and "no attribute 'get'" in str(out[1])
    assert max(took) < 30  # told in the same round, not after the 60 s timeout


def test_inductors_key_names_the_processors_features(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.jit import _tools

    info = tmp_path / "cpuinfo"
    keys = []
    for flags in ("fpu sse2 avx2 avx512f", "avx512f avx2 sse2 fpu", "fpu sse2 avx2"):
        info.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\n"
                        f"processor\t: 1\nflags\t\t: other\n")
        monkeypatch.setattr(_tools, "CPUINFO", str(info))
        keys.append((jit.family("inductor", environ={
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c")}).key,
            jit.family("vllm", environ={"VLLM_CACHE_ROOT": str(tmp_path / "v")}).key))
    # The same features in another order: one key; a processor without AVX-512: another
    # key, so it never runs a kernel built with it.
    assert keys[0] == keys[1] and keys[1][0] != keys[2][0] and keys[1][1] != keys[2][1]
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert _tools.cpu_features(str(info)) != _tools.cpu_features(str(tmp_path / "absent"))
    assert _tools.cpu_features(str(tmp_path / "absent")) == (
        __import__("platform").machine() or "unknown")


def test_a_placements_temporary_file_left_by_a_killed_writer_is_removed_once_stale(
    tmp_path: Path,
) -> None:
    pool = _built(tmp_path)
    fresh = tmp_path / "fresh"
    (fresh / "zz").mkdir(parents=True)
    stale = fresh / "zz" / ".k2.so.4242.deadbeef.distcache.tmp"  # a writer killed at it
    recent = fresh / "zz" / ".k9.so.4343.cafecafe.distcache.tmp"  # one still writing
    other = fresh / "zz" / ".keep.tmp"  # a tool's own hidden file
    for path in (stale, recent, other):
        path.write_bytes(b"x" * 100)
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    placed = Family(FamilySpec("inductor", KEY, (Root(fresh),)), pool).materialize()
    assert placed.written == len(FILES)
    assert not stale.exists() and recent.exists() and other.exists()
