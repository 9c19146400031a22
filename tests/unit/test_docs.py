"""The README and ``docs/`` say what the code does and hold together.

Every ``DISTCACHE_*`` variable the code reads is in the settings table and in
``docs/configuration.md`` with its default; the README keeps the two commands CI runs
and stays short; every link between the pages resolves, down to the heading; every
page under ``docs/`` is reachable from the README; no page names a machine's paths.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from distcache.config import ENV_VARS

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS, REPO / "ARCHITECTURE.md"]
# Set by `python -m launch` for the program it runs; distcache itself never reads them.
EXPORTED_ONLY = {"DISTCACHE_WORKSPACE", "DISTCACHE_PREFETCH_MANIFEST"}
# Read by the test harness and the benchmark scripts, not by the library.
TEST_ONLY = {"DISTCACHE_TEST_COMM", "DISTCACHE_TEST_IPC_BACKEND"}
# Set by the library in a process for the processes it starts, not a setting: the owner
# of a compile cache (distcache/integrations/_compile_caches.py).
HANDED_DOWN = {"DISTCACHE_JIT_OWNER"}
#: A newcomer reads the README in five minutes; the reference lives under docs/.
README_MAX_LINES = 250
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _variables_in(paths: list[Path]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        found |= set(re.findall(r"DISTCACHE_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    return found


def _prose(text: str) -> str:
    """``text`` without its fenced blocks (links and headings live outside them)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), re.MULTILINE):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


def _links(page: Path) -> list[str]:
    return [link for link in _LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z]+:", link)]


def test_every_variable_the_library_reads_is_documented_in_the_settings_table() -> None:
    sources = [*REPO.joinpath("distcache").rglob("*.py"), *REPO.joinpath("launch").rglob("*.py")]
    used = _variables_in(sources) - EXPORTED_ONLY - TEST_ONLY - HANDED_DOWN
    assert used - set(ENV_VARS) == set()


def test_the_configuration_page_lists_every_setting_with_its_default() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(DISTCACHE_[A-Z_]+)` \| ([^|]+) \|", text, re.MULTILINE))
    assert set(rows) == set(ENV_VARS)
    for name, (default, _) in ENV_VARS.items():
        assert default in rows[name].replace("`", ""), (
            f"docs/configuration.md gives {name} the default {rows[name].strip()!r}; "
            f"config.py says {default!r}")


def test_the_readme_quick_start_has_the_two_make_targets_ci_runs() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```bash\n(.*?)^```", quick, re.MULTILINE | re.DOTALL)
    assert block is not None
    assert [line.split("#")[0].strip() for line in block.group(1).splitlines()] == [
        "make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move reference material under docs/")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_between_the_pages_resolves(page: Path) -> None:
    for link in _links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / unquote(target)).resolve() if target else page
        assert path.exists(), f"{page.relative_to(REPO)}: {link} names no file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), (
                f"{page.relative_to(REPO)}: {link}: no heading #{anchor} in "
                f"{path.relative_to(REPO)} (has {sorted(_anchors(path))})")


def test_every_page_under_docs_is_linked_from_the_readme() -> None:
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _links(README)}
    assert DOCS
    assert {page.resolve() for page in DOCS} - linked == set()


def test_the_link_checker_catches_a_broken_anchor() -> None:
    assert "python--m-launch" in _anchors(REPO / "docs" / "launchers.md")
    assert "no-such-heading" not in _anchors(REPO / "docs" / "launchers.md")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_names_a_machine_path(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"(?<![\w.])/(?:tmp|work|home|root)/", text), (
        f"{page.relative_to(REPO)} names a machine path")
