"""A cache variable set blank is read as the tool reads it, so the family fills and
publishes the directory the tool compiles into. FlashInfer takes a blank
``FLASHINFER_WORKSPACE_BASE`` as the working directory (``Path("")``) and Triton a blank
``TRITON_HOME`` the same way (``os.path.join("", ".triton", "cache")``): each is asked
in a child process started in that directory, next to the family's answer there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distcache import jit

ASK = {
    # Where FlashInfer builds its JIT ops, and where Triton's own cache manager writes.
    "flashinfer_jit": "import flashinfer.jit.env as e; print(e.FLASHINFER_CACHE_DIR)",
    "triton": "from triton import knobs; print(knobs.cache.dir)",
}
CASES = [
    ("flashinfer_jit", {"FLASHINFER_WORKSPACE_BASE": ""}),
    ("flashinfer_jit", {"FLASHINFER_WORKSPACE_BASE": "ws"}),
    ("flashinfer_jit", {}),
    ("triton", {"TRITON_HOME": ""}),
    ("triton", {"TRITON_HOME": "th"}),
    ("triton", {}),
]
IDS = ["flashinfer-blank", "flashinfer-relative", "flashinfer-unset", "triton-blank",
       "triton-relative", "triton-unset"]


def _tool_dir(family: str, env: dict[str, str], cwd: Path) -> Path:
    base = {k: v for k, v in os.environ.items()
            if k not in ("FLASHINFER_WORKSPACE_BASE", "TRITON_HOME", "TRITON_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", ASK[family]],
                         env={**base, **env}, cwd=cwd, capture_output=True, text=True,
                         timeout=120, check=True)
    return Path(os.path.abspath(os.path.join(cwd, out.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_the_family_directory_is_the_tools(case: int, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    family, given = CASES[case]
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), **given}
    expected = _tool_dir(family, env, tmp_path)
    monkeypatch.chdir(tmp_path)
    fam = jit.family(family, environ=env)
    assert fam.materialize_dir() == expected, json.dumps(given)
    assert fam.key.endswith(f";dir={expected}")
    if given and not next(iter(given.values())):  # blank: the working directory's
        assert expected.is_relative_to(tmp_path) and not expected.is_relative_to(home)


@pytest.mark.parametrize("given", ["", "ws", None], ids=["blank", "relative", "unset"])
def test_the_loaders_fallback_cubin_directory_is_flashinfers(
        given: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FlashInfer keeps cubins, computed before its ``env`` module is loaded."""
    from distcache.integrations.flashinfer import _upstream

    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)} if given is None else {
        "HOME": str(home), "FLASHINFER_WORKSPACE_BASE": given}
    expected = _tool_dir("flashinfer_jit", env, tmp_path) / "cubins"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(home))
    if given is None:
        monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    else:
        monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", given)
    monkeypatch.delitem(sys.modules, _upstream.ENV_MODULE, raising=False)
    assert Path(os.path.abspath(_upstream.flashinfer_cache_dir())) == expected
