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



_SHA = "ab" * 32
_TRICKY = [
    "..", "a/..", "../a", "/abs", "//abs", "a\\b", "\\", "a\x00b", "a\tb", "a b", "*a", "**a",
    "x" * 1024, "x" * 1025, "/".join(["y" * 255] * 4), "z" * 256, "caf\u00e9", "cafe\u0301",
    "a\u2215b", "\uff0e\uff0e", "a\u2028b", "ok/name.cubin", "a//b", "a/", "...", ".a", "a.",
]


def _parsed(line: str) -> tuple[str, object]:
    from distcache.artifact import parse_checksums

    try:
        return ("ok", [(a.name, a.sha256, a.size) for a in parse_checksums(line)])
    except (ArtifactNameError, ValueError) as exc:
        return ("rejected", type(exc).__name__)


def _as_written(line: str) -> str:
    """The name sha256sum wrote on ``line``: what follows the digest, its space and
    its mode character (a space or '*'), exactly, less a "\\r" line end."""
    return line.removesuffix("\r")[66:]


def _by_the_rules(name: str) -> tuple[str, object]:
    from distcache.artifact import Artifact

    try:
        validate_name(name)
        artifact = Artifact(_validate_slowly(name), _SHA)
    except (ArtifactNameError, ValueError) as exc:
        return ("rejected", type(exc).__name__)
    return ("ok", [(artifact.name, artifact.sha256, artifact.size)])


@pytest.mark.parametrize("name", _TRICKY)
@pytest.mark.parametrize("frame", ["{sha}  {name}", "{sha} *{name}", "{SHA}  {name}"])
def test_the_manifest_fast_path_agrees_with_the_rules(name: str, frame: str) -> None:
    line = frame.format(sha=_SHA, SHA=_SHA.upper(), name=name)
    assert _parsed(line) == _by_the_rules(_as_written(line))


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet=_ALPHABET + "\x00\u2028", min_size=1, max_size=12))
def test_parsed_manifest_lines_agree_with_the_rules(name: str) -> None:
    stripped = name.strip()
    if not stripped or stripped.startswith("#"):
        return
    line = f"{_SHA}  {name}"
    if "\n" in line or not _as_written(line):
        return
    assert _parsed(line) == _by_the_rules(_as_written(line))
