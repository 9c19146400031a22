"""Every benchmark figure the documentation quotes is what the committed JSON says.

The figures live in ``<!-- figures:NAME -->`` blocks, in README.md or ``docs/*.md``
(most in ``docs/benchmarks.md``), that ``scripts/readme_figures.py`` renders from
``docs/bench/*.json``; a block that differs from its rendering is a figure that drifted
from its measurement.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEXT = {page: page.read_text() for page in PAGES}
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
    "scale.json": "scripts/bench_scale.py",
    "engine_vllm.json": "scripts/engine_vllm.py",
    "jit.json": "scripts/bench_jit.py",
    "lazy.json": "scripts/bench_lazy.py",
    "lazy_scale.json": "scripts/scale_model.py",
}


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_figures",
                                                  REPO / "scripts" / "readme_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURES = re.compile(r"<!-- figures:(\w+) -->\n(.*?)<!-- /figures:\1 -->", re.DOTALL)
BLOCKS = [(name, block) for text in TEXT.values() for name, block in FIGURES.findall(text)]
#: Images a page shows, as (page, link relative to the page).
IMAGES = [(page, link) for page, text in TEXT.items()
          for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", text)]


def test_the_pages_have_figure_blocks() -> None:
    names = [name for name, _ in BLOCKS]
    assert set(names) == set(_renderer().RENDERERS), "every figure the script renders is shown"
    assert len(names) == len(set(names)), f"a block appears twice: {sorted(names)}"
    assert FIGURES.findall(TEXT[REPO / "docs" / "benchmarks.md"])


def test_the_script_rewrites_every_page_that_holds_blocks() -> None:
    holding = {page for page, text in TEXT.items() if FIGURES.search(text)}
    assert holding <= set(_renderer().pages())
    assert REPO / "docs" / "reliability.md" in holding
    assert {REPO / "docs" / "jit.md", REPO / "docs" / "engines.md"} <= holding


@pytest.mark.parametrize("name,block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_each_block_is_its_json_rendered(name: str, block: str) -> None:
    assert block == _renderer().render(name), (
        f"figures:{name} differ from docs/bench; run "
        "`python scripts/readme_figures.py --write`")


def test_committed_json_is_named_as_its_script_writes_it() -> None:
    for path in BENCH.glob("*.json"):
        assert path.name in WRITTEN_AS, f"{path.name} is not a name any script writes"
        script = (REPO / WRITTEN_AS[path.name]).read_text()
        assert path.name in script, f"{WRITTEN_AS[path.name]} does not write {path.name}"
        json.loads(path.read_text())


def test_images_the_pages_show_are_committed_next_to_their_json() -> None:
    assert IMAGES
    for page, link in IMAGES:
        image = (page.parent / link).resolve()
        assert image.is_relative_to(BENCH.resolve()), f"{page.name}: {link} is not in docs/bench"
        assert image.exists(), f"{page.name}: {link}"
        assert image.with_suffix(".json").exists(), f"{page.name}: {link}"


def test_a_committed_soak_records_its_seed() -> None:
    soak = BENCH / "soak.json"
    if not soak.exists():
        assert not any("soak.json" in text for text in TEXT.values())
        return
    assert isinstance(json.loads(soak.read_text())["seed"], int)


def test_a_figure_that_drifts_is_caught(tmp_path: Path) -> None:
    block = dict(BLOCKS)["pool"]
    data = json.loads((BENCH / "bench_pool.json").read_text())
    assert f"{data['ratio_pool_over_direct']:.3f}" in block
    drifted = block.replace(f"{data['ratio_pool_over_direct']:.3f}", "0.999")
    assert drifted != _renderer().render("pool")
