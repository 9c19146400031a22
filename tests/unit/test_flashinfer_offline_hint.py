"""The offline miss's hint is a recipe that works as printed.

It said ``distcache fetch --manifest need.txt`` without an origin (which fails on a
machine that only has FlashInfer's repository set) and ``pool export --tar`` of the
whole pool. It now names the repository (without its credentials) and exports only
what need.txt lists; run verbatim on a connected machine whose pool holds other
artifacts too, its tarball imports the one kernel.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.integrations.flashinfer._loader import fetch_hint
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin
from tests.support.cli import REPO, cli_env, run_cli


def test_the_hint_names_the_repository_without_its_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", "https://alice:s3cret@repo.example/c/")
    hint = fetch_hint(Artifact("pin/k.cubin", "ab" * 32))
    assert "--origin https://repo.example/c" in hint
    assert "s3cret" not in hint and "alice" not in hint
    assert "pool export --manifest need.txt --tar need.tar" in hint


def test_the_hint_run_verbatim_brings_the_one_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    mirror = tmp_path / "mirror"
    (mirror / "pin").mkdir(parents=True)
    need, other = os.urandom(2000), os.urandom(3000)
    (mirror / "pin" / "need.cubin").write_bytes(need)
    (mirror / "pin" / "other.cubin").write_bytes(other)
    env = cli_env(tmp_path)
    env["DISTCACHE_POOL"] = str(tmp_path / "connected-pool")
    with LoopbackOrigin(mirror) as origin:
        env["FLASHINFER_CUBINS_REPOSITORY"] = origin.url
        monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", origin.url)
        (tmp_path / "other.txt").write_text(
            f"{hashlib.sha256(other).hexdigest()}  pin/other.cubin\n")
        assert run_cli(env, "fetch", "--manifest", str(tmp_path / "other.txt"),
                       "--origin", origin.url).returncode == 0
        hint = fetch_hint(Artifact("pin/need.cubin", hashlib.sha256(need).hexdigest()))
        connected = hint.removeprefix("on a connected machine run: ").split("; then here: ")[0]
        env["PYTHONPATH"] = str(REPO)
        script = connected.replace("distcache ", f"{sys.executable} -m distcache ")
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
    with tarfile.open(tmp_path / "need.tar") as tar:
        assert sorted(tar.getnames()) == ["checksums.txt", "pin/need.cubin"]
    offline = tmp_path / "offline-pool"
    assert run_cli(env, "--pool", str(offline), "pool", "import",
                   str(tmp_path / "need.tar")).returncode == 0
    assert ArtifactPool(offline).get(hashlib.sha256(need).hexdigest()) == need
