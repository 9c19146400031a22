"""Every benchmark figure the README quotes is what the committed JSON says.

The README's figures live in ``<!-- figures:NAME -->`` blocks that
``scripts/readme_figures.py`` renders from ``docs/bench/*.json``; a block that differs
from its rendering is a figure that drifted from its measurement.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BENCH = REPO / "docs" / "bench"
# The JSON each script writes, by the name it writes it under.
WRITTEN_AS = {
    "bench_prefetch.json": "scripts/bench_prefetch.py",
    "bench_family.json": "scripts/bench_family.py",
    "bench_downloads.json": "scripts/bench_downloads.py",
    "bench_pool.json": "scripts/bench_pool.py",
    "bench_ipc.json": "scripts/bench_ipc.py",
    "scale_model.json": "scripts/scale_model.py",
    "soak.json": "scripts/soak.py",
}


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_figures",
                                                  REPO / "scripts" / "readme_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BLOCKS = re.findall(r"<!-- figures:(\w+) -->\n(.*?)<!-- /figures:\1 -->", README, re.DOTALL)


def test_the_readme_has_figure_blocks() -> None:
    assert {name for name, _ in BLOCKS} >= {"prefetch", "scale", "pool"}


@pytest.mark.parametrize("name,block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_each_block_is_its_json_rendered(name: str, block: str) -> None:
    assert block == _renderer().render(name), (
        f"README figures:{name} differ from docs/bench; run "
        "`python scripts/readme_figures.py --write`")


def test_committed_json_is_named_as_its_script_writes_it() -> None:
    for path in BENCH.glob("*.json"):
        assert path.name in WRITTEN_AS, f"{path.name} is not a name any script writes"
        script = (REPO / WRITTEN_AS[path.name]).read_text()
        assert path.name in script, f"{WRITTEN_AS[path.name]} does not write {path.name}"
        json.loads(path.read_text())


def test_images_the_readme_shows_are_committed_next_to_their_json() -> None:
    for image in re.findall(r"\]\((docs/bench/[\w.]+\.png)\)", README):
        assert (REPO / image).exists(), image
        assert (REPO / image).with_suffix(".json").exists(), image


def test_a_committed_soak_records_its_seed() -> None:
    soak = BENCH / "soak.json"
    if not soak.exists():
        assert "docs/bench/soak.json" not in README
        return
    assert isinstance(json.loads(soak.read_text())["seed"], int)


def test_a_figure_that_drifts_is_caught(tmp_path: Path) -> None:
    block = dict(BLOCKS)["pool"]
    data = json.loads((BENCH / "bench_pool.json").read_text())
    assert f"{data['ratio_pool_over_direct']:.3f}" in block
    drifted = block.replace(f"{data['ratio_pool_over_direct']:.3f}", "0.999")
    assert drifted != _renderer().render("pool")
