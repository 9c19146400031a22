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
    "engine_startup.json": "scripts/bench_prefetch.py",
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
    "startup_scale.json": "scripts/scale_model.py",
    "install_beside.json": "scripts/bench_install_beside.py",
}


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_figures",
                                                  REPO / "scripts" / "readme_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURES = re.compile(r"<!-- figures:(\w+) -->\n(.*?)<!-- /figures:\1 -->", re.DOTALL)
#: Every block, as (page, name, block).
PAGE_BLOCKS = [(page, name, block) for page, text in TEXT.items()
               for name, block in FIGURES.findall(text)]
BLOCKS = [(name, block) for _, name, block in PAGE_BLOCKS]
#: Images a page shows, as (page, link relative to the page).
IMAGES = [(page, link) for page, text in TEXT.items()
          for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", text)]


def test_the_pages_have_figure_blocks() -> None:
    names = [name for name, _ in BLOCKS]
    assert set(names) == set(_renderer().RENDERERS), "every figure the script renders is shown"
    for page in PAGES:
        on_page = [name for where, name, _ in PAGE_BLOCKS if where == page]
        assert len(on_page) == len(set(on_page)), f"a block appears twice in {page.name}"
    assert FIGURES.findall(TEXT[REPO / "docs" / "benchmarks.md"])


def test_the_script_rewrites_every_page_that_holds_blocks() -> None:
    holding = {page for page, text in TEXT.items() if FIGURES.search(text)}
    assert holding <= set(_renderer().pages())
    assert REPO / "docs" / "reliability.md" in holding
    assert {REPO / "docs" / "jit.md", REPO / "docs" / "engines.md"} <= holding


@pytest.mark.parametrize("name,block", BLOCKS,
                         ids=[f"{page.name}:{name}" for page, name, _ in PAGE_BLOCKS])
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


def _bench_copy(tmp_path: Path, *names: str) -> ModuleType:
    """The renderer reading ``tmp_path``, which holds copies of the committed ``names``."""
    module = _renderer()
    for name in names:
        (tmp_path / name).write_text((BENCH / name).read_text())
    setattr(module, "BENCH", tmp_path)  # noqa: B010  (a module loaded from a path)
    return module


def test_a_block_whose_json_is_not_committed_says_so(tmp_path: Path) -> None:
    module = _bench_copy(tmp_path)
    for name, json_name in (("engine_startup", "engine_startup.json"),
                            ("family", "bench_family.json"), ("startup", "scale.json")):
        text = module.render(name)
        assert "Not measured in the committed figures yet" in text and json_name in text


def test_start_up_at_scale_extrapolates_when_the_model_is_committed(tmp_path: Path) -> None:
    module = _bench_copy(tmp_path, "scale.json")
    alone = module.render("startup")
    assert "not in the committed figures yet" in alone and "4,096 (" not in alone
    rows = json.loads((BENCH / "scale.json").read_text())["rows"]
    for r in rows:
        assert f"| {r['ranks']:,} ({r['nodes']:,}) | {r['origin_requests']:,} |" in alone
        assert f"{r['control_bytes_per_rank']['max']:,} |" in alone
    # The model's output as ``scripts/scale_model.py --startup`` writes it: a resolved
    # slope gets a value and its 95 % upper bound, an unresolved one the bound alone.
    fits: dict[str, dict[str, float]] = {
        "control_bytes_max": {"a": 4649.3, "b_per_node": 1695.0, "b_low_95": 1600.0,
                              "b_high_95": 1790.0},
        "rss_beyond_bucket_mb": {"a": 16.6, "b_per_node": -0.04, "b_low_95": -0.47,
                                 "b_high_95": 0.39}}
    resolved = {"control_bytes_max": True, "rss_beyond_bucket_mb": False}
    predictions = {str(n): {"ranks": 8 * n,
                            **{k: f["a"] + f["b_per_node"] * n if resolved[k] else None
                               for k, f in fits.items()},
                            **{f"{k}_upper_95": f["a"] + f["b_high_95"] * n
                               for k, f in fits.items()}}
                   for n in (512, 1024, 4096)}
    units = {"control_bytes_max": "bytes", "rss_beyond_bucket_mb": "MB"}
    (tmp_path / "startup_scale.json").write_text(json.dumps({
        "ranks_per_node": 8, "measured": {"nodes": [float(r["nodes"]) for r in rows]},
        "fits": {k: {**f, "unit": units[k], "slope_resolved": resolved[k]}
                 for k, f in fits.items()},
        "nodes": [512, 1024, 4096], "predictions": predictions}))
    text = module.render("startup")
    assert text.startswith(alone.split("\n\n_The extrapolation")[0])
    assert "| 1,024 (8,192) | 1,740,329 (1,837,609) | - (416 MB) |" in text
    assert "| 4,096 (32,768) | 6,947,369 (7,336,489) | - (1,614 MB) |" in text
    assert "not resolved (95 % upper bound)" in text and "which holds zero" in text
    assert "512 (" not in text and "not in the committed figures yet" not in text
