"""Every DISTCACHE_* variable the code reads is in the settings table and the README."""

from __future__ import annotations

import re
from pathlib import Path

from distcache.config import ENV_VARS

REPO = Path(__file__).resolve().parents[2]
# Set by `python -m launch` for the program it runs; distcache itself never reads them.
EXPORTED_ONLY = {"DISTCACHE_WORKSPACE", "DISTCACHE_PREFETCH_MANIFEST"}
# Read by the test harness and the benchmark scripts, not by the library.
TEST_ONLY = {"DISTCACHE_TEST_COMM", "DISTCACHE_TEST_IPC_BACKEND"}


def _variables_in(paths: list[Path]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        found |= set(re.findall(r"DISTCACHE_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    return found


def test_every_variable_the_library_reads_is_documented_in_the_settings_table() -> None:
    sources = [*REPO.joinpath("distcache").rglob("*.py"), *REPO.joinpath("launch").rglob("*.py")]
    used = _variables_in(sources) - EXPORTED_ONLY - TEST_ONLY
    assert used - set(ENV_VARS) == set()


def test_the_readme_lists_every_setting_with_its_default() -> None:
    readme = (REPO / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(DISTCACHE_[A-Z_]+)` \| ([^|]+) \|", readme, re.MULTILINE))
    assert set(rows) == set(ENV_VARS)


def test_the_readme_quick_start_has_the_two_make_targets_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()
