"""validate_name's one-regex fast path accepts and returns exactly what the rules do."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distcache.artifact import _validate_slowly, validate_name
from distcache.errors import ArtifactNameError

# Characters around every rule's edge: dots, slashes, the fast set, and what it excludes.
_ALPHABET = "ab.-_/+=~ *\\\t\u2215\uff0f\u00e9e\u0301"


def _outcome(fn: object, name: str) -> tuple[str, str]:
    try:
        return ("ok", fn(name))  # type: ignore[operator]
    except ArtifactNameError as exc:
        return ("rejected", type(exc).__name__)


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=_ALPHABET, max_size=12))
def test_the_fast_path_agrees_with_the_rules(name: str) -> None:
    assert _outcome(validate_name, name) == _outcome(_validate_slowly, name)


@pytest.mark.parametrize("name", [
    "a" * 256, "/".join(["a" * 255] * 5), "a/" + "b" * 255, "a//b", "a///b/c", "...",
    "a/../b", ".hidden/x", "x/..a", "a/.", "a/", "-/~/+=,@%", "x" * 1025,
])
def test_edge_names_agree(name: str) -> None:
    assert _outcome(validate_name, name) == _outcome(_validate_slowly, name)

