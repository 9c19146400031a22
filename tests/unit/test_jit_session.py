"""``init(jit_caches=...)`` and ``DISTCACHE_JIT_CACHES`` at world size 1: the pool's
trees fill the directory at init, ``Session.sync()`` publishes what was built, and the
pool carries families through ``pool export`` and ``import``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distcache import jit
from distcache.cli import main
from distcache.comm import local
from distcache.errors import ConfigError
from distcache.session import SessionSlot
from distcache.store import ArtifactPool


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DISTCACHE_", "TORCHINDUCTOR_", "TRITON_"))}
    env.update(DISTCACHE_POOL=str(tmp_path / "pool"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TMPDIR=str(tmp_path), **extra)
    return env


def seed(pool: ArtifactPool, env: dict[str, str], files: dict[str, bytes], where: Path) -> None:
    for rel, data in files.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_bytes(data)
    # Published under the key of the directory the session will use.
    spec = jit.family("inductor", environ=env).spec
    jit.Family(jit.FamilySpec(spec.name, spec.key, (jit.Root(where),)), pool).publish()


def test_init_fills_the_directory_and_sync_publishes_what_was_built(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    pool = ArtifactPool(tmp_path / "pool")
    seed(pool, env, {"fxgraph/ab/entry": b"graph", "ab/k.so": b"kernel"}, tmp_path / "elsewhere")
    slot = SessionSlot()
    with slot.init(comm=local(), integrations=(), jit_caches=["inductor"], environ=env) as s:
        built = tmp_path / "inductor"
        assert (built / "fxgraph/ab/entry").read_bytes() == b"graph"
        assert (built / "ab/k.so").read_bytes() == b"kernel"
        (families,) = [i for i in s.integrations if isinstance(i, jit.Family)]
        assert families.report.placed.written == 2
        (built / "cd").mkdir()
        (built / "cd/new.so").write_bytes(b"built during warm-up")
        s.sync()
        assert families.report.published == 1
    key = jit.family("inductor", environ=env).key
    merged = jit.union(jit.read_trees(ArtifactPool(tmp_path / "pool"), "inductor", key))
    assert sorted(merged.entries) == ["ab/k.so", "cd/new.so", "fxgraph/ab/entry"]


def test_the_variable_names_the_families_and_a_bad_name_is_refused(tmp_path: Path) -> None:
    env = env_for(tmp_path, DISTCACHE_JIT_CACHES="inductor")
    with SessionSlot().init(comm=local(), integrations=(), environ=env) as session:
        assert [i.name for i in session.integrations] == ["inductor"]
    with pytest.raises(ConfigError, match="unknown JIT cache 'torch'"):
        SessionSlot().init(comm=local(), integrations=(), jit_caches=["torch"], environ=env)
    with pytest.raises(ConfigError, match="a list of names"):
        SessionSlot().init(comm=local(), integrations=(), jit_caches="inductor", environ=env)


def test_pool_export_and_import_carry_a_family(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    pool = ArtifactPool(tmp_path / "pool")
    files = {"fxgraph/ab/entry": b"graph", "ab/k.so": b"kernel" * 100}
    seed(pool, env, files, tmp_path / "built")
    assert main(["pool", "--pool", str(tmp_path / "pool"), "export", "--tar",
                 str(tmp_path / "set.tar")]) == 0
    assert main(["pool", "--pool", str(tmp_path / "airgapped"), "import",
                 str(tmp_path / "set.tar")]) == 0
    other = ArtifactPool(tmp_path / "airgapped")
    target = tmp_path / "target"
    key = jit.family("inductor", environ=env).key
    spec = jit.FamilySpec("inductor", key, (jit.Root(target),))
    assert jit.Family(spec, other).materialize().written == len(files)
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == set(files)


def test_torchs_precompiled_headers_are_part_of_the_inductor_family(tmp_path: Path) -> None:
    import getpass

    env = env_for(tmp_path)
    headers = tmp_path / f"torchinductor_{getpass.getuser()}" / "precompiled_headers"
    headers.mkdir(parents=True)
    (headers / "c1.h.gch").write_bytes(b"precompiled")
    pool = ArtifactPool(tmp_path / "pool")
    family = jit.family("inductor", pool=pool, environ=env)
    assert family.publish() == 1
    (tree,) = jit.read_trees(pool, "inductor", family.key)
    assert [e.path for e in tree.entries] == ["precompiled_headers@default/c1.h.gch"]
    (headers / "c1.h.gch").unlink()
    assert family.materialize().written == 1
    assert (headers / "c1.h.gch").read_bytes() == b"precompiled"
