"""The ``vllm`` family's directory is the one vLLM compiles into (vllm/envs.py:
``VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``, ``~``
expanded; a variable set blank read as ``os.getenv`` gives it, relative to the working
directory), so what a rank compiled is published and what the pool holds is found."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from distcache import jit
from distcache.store import ArtifactPool
from tests.unit.test_jit_family import fill

COMPILED = {"h/rank_0_0/vllm_compile_cache.py": b"{}\n", "h/rank_0_0/model": b"compiled" * 40}

IDS = ["xdg", "root-under-tilde", "root-is-tilde", "xdg-under-tilde", "root-before-xdg",
       "default", "blank-xdg", "blank-root"]


def _cases(tmp: Path) -> list[tuple[dict[str, str], Path]]:
    """(environment, vLLM's compile cache directory) with ``HOME`` = ``tmp/home``."""
    home, xdg, given = tmp / "home", tmp / "xdg", tmp / "given"
    cache = "torch_compile_cache"
    return [
        ({"XDG_CACHE_HOME": str(xdg)}, xdg / "vllm" / cache),
        ({"VLLM_CACHE_ROOT": "~/vc"}, home / "vc" / cache),
        ({"VLLM_CACHE_ROOT": "~"}, home / cache),
        ({"XDG_CACHE_HOME": "~/xc"}, home / "xc" / "vllm" / cache),
        ({"VLLM_CACHE_ROOT": str(given), "XDG_CACHE_HOME": str(xdg)}, given / cache),
        ({}, home / ".cache" / "vllm" / cache),
        # Blank: os.getenv gives "", so vLLM's root is relative to the working directory.
        ({"XDG_CACHE_HOME": ""}, tmp / "vllm" / cache),
        ({"VLLM_CACHE_ROOT": "", "XDG_CACHE_HOME": str(xdg)}, tmp / cache),
    ]


@pytest.mark.parametrize("case", range(len(IDS)), ids=IDS)
def test_the_directory_is_the_one_vllm_compiles_into(
    case: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env, expected = _cases(tmp_path)[case]
    fam = jit.family("vllm", environ={"HOME": str(tmp_path / "home"), **env})
    assert fam.materialize_dir() == expected
    assert fam.key.endswith(f";dir={expected}")


@pytest.mark.parametrize("case", range(2), ids=IDS[:2])
def test_what_vllm_compiled_is_published_and_a_cold_start_finds_it_there(
    case: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env, compiled = _cases(tmp_path)[case]
    environ = {"HOME": str(tmp_path / "home"), **env}
    pool = ArtifactPool(tmp_path / "pool")
    fill(compiled, COMPILED)
    assert jit.family("vllm", pool=pool, environ=environ).publish() == len(COMPILED)
    shutil.rmtree(compiled)  # the next start on a node whose cache is empty
    placed = jit.family("vllm", pool=pool, environ=environ).materialize()
    assert placed.written == len(COMPILED)
    assert {rel: (compiled / rel).read_bytes() for rel in COMPILED} == COMPILED
    assert not (tmp_path / "~").exists()
