"""Artifact names are hostile input: nothing they say may reach outside its directory.

Two layers are checked. :func:`validate_name` either raises ``ArtifactNameError`` or
returns a name whose path stays strictly inside any root. And the code that turns
names into files (the pool's ``materialize`` and ``remember``, ``DirOrigin`` and the
FlashInfer loader) never opens, creates, renames or links anything outside the pool
root, the caller's directory or the mirror: an audit hook records every such call
while the property runs, and the whole sandbox tree (with sentinels and symlinks that
point out of it) is compared before and after.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcache.artifact import (
    MAX_NAME_BYTES,
    MAX_SEGMENT_BYTES,
    Artifact,
    check_sha256,
    path_under,
    sha256_hex,
    validate_name,
)
from distcache.errors import ArtifactNameError, IntegrityError, OriginError, PoolError
from distcache.integrations.flashinfer._loader import PooledLoader
from distcache.origins import DirOrigin
from distcache.store._pool import ArtifactPool

# Deterministic and database-less, so CI sees the same examples on every run.
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow])
SANDBOX_FUZZ = settings(FUZZ, max_examples=120)

DATA = b"kernel bytes for the sandbox\n" * 8
SHA = sha256_hex(DATA)

# Pieces that have broken path handling somewhere, glued together by hypothesis.
HOSTILE_PIECES = [
    "..", ".", "", "/", "//", "///", "\\", "\x00", "\n", "\r", "\t", "\x7f", "\x1b",
    "\u202e",  # right-to-left override
    "\u200d", "\u200b", "\ufeff",  # zero-width joiner, space, BOM
    "\uff0f", "\uff3c", "\u2215", "\u2044", "\u29f8", "\u2216",  # slash look-alikes
    "\u2024", "\u2025", "\u2026", "\uff0e", "\ufe52",  # dot leaders, fullwidth stops
    "e\u0301", "\u00e9", "\u212b", "\u00c5",  # NFD / NFC / singleton-decomposing
    "\u2028", "\u2029", "\x85",  # line separators
    "\ud800", "\udfff",  # lone surrogates
    " ", "\u00a0", "*", "~", "%2e%2e", "%2f", ":", "?", "#",
    "a", "b", "fmha", "trtllm-gen", "k.cubin", "sub/", "escape/",
    "x" * (MAX_SEGMENT_BYTES + 1), "\u00e9" * 128,
]
names = st.one_of(
    st.lists(st.sampled_from(HOSTILE_PIECES), max_size=8).map("".join),
    st.text(max_size=40),
    st.lists(st.sampled_from(["a", "..", ".", "", "b.cubin"]), max_size=6).map("/".join),
)


# -- validate_name ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "..", "../x", "a/../../b", "a/..", "/etc/passwd", "//etc/passwd", "a/./b", "a/",
        "a\\..\\b", "a\x00b", "a\nb", "a\x7fb",
        "a\u202eb",  # right-to-left override
        "a\u200db", "..\u200b", "\ufeffa",  # zero-width characters
        "a\uff0f..\uff0fb", "a\u2215b", "a\u2044b", "a\u29f8b", "a\uff3cb", "a\u2216b",
        "\u2024\u2024/x", "\u2025", "\uff0e\uff0e/x", "\ufe52\ufe52", "\u2026", "...",
        "e\u0301.cubin",  # NFD: on a normalising filesystem this is "é.cubin"
        "a\u2028b", "a\u2029b", "a\x85b",
        "x/ .. /y", ".. ", " a", "a ", "a/b ",
        "*a.cubin",
        "\ud800",
        "x" * (MAX_SEGMENT_BYTES + 1),
        "a/" * (MAX_NAME_BYTES // 2) + "a",
        "",
    ],
)
def test_hostile_names_are_rejected(name: str) -> None:
    with pytest.raises(ArtifactNameError) as info:
        validate_name(name)
    assert getattr(info.value, "name", None) == name
    assert getattr(info.value, "reason", "")


@pytest.mark.parametrize("name", [None, b"a.cubin", 1, 1.5, ["a"], Path("a.cubin"), object()])
def test_non_strings_are_rejected(name: Any) -> None:
    with pytest.raises(ArtifactNameError, match="not a string"):
        validate_name(name)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a//b", "a/b"),
        ("fmha//trtllm-gen///k.cubin", "fmha/trtllm-gen/k.cubin"),
        ("\u00e9.cubin", "\u00e9.cubin"),
        ("a b/c-d_e.f+g@h.cubin", "a b/c-d_e.f+g@h.cubin"),
        ("x" * MAX_SEGMENT_BYTES, "x" * MAX_SEGMENT_BYTES),
        ("a\u2026b", "a\u2026b"),  # an ellipsis inside a word is just a character
    ],
)
def test_safe_names_are_kept_with_doubled_slashes_collapsed(name: str, expected: str) -> None:
    assert validate_name(name) == expected


def test_sha256_with_a_trailing_newline_is_rejected() -> None:
    # "$" in a regex matches before a final "\n"; a digest must be exactly 64 hex.
    with pytest.raises(ValueError):
        check_sha256("a" * 64 + "\n")
    with pytest.raises(ValueError):
        Artifact("k.cubin", "a" * 64 + "\n")


@FUZZ
@given(names)
def test_validated_names_stay_strictly_inside_any_root(name: str) -> None:
    root = Path("/srv/pool/into")
    try:
        clean = validate_name(name)
    except ArtifactNameError:
        with pytest.raises(ArtifactNameError):
            path_under(root, name)
        return
    assert validate_name(clean) == clean  # normalising twice changes nothing
    path = path_under(root, name)
    resolved = Path(os.path.normpath(path))
    assert resolved != root and resolved.is_relative_to(root)
    assert path.relative_to(root).parts == tuple(clean.split("/"))
    assert len(clean.encode("utf-8")) <= MAX_NAME_BYTES


# -- the sandbox: nothing outside the pool, the caller's directory or the mirror ---------

_WATCHED = {"open", "os.mkdir", "os.rename", "os.link", "os.symlink", "os.remove",
            "os.rmdir", "os.truncate", "os.chmod", "os.chown", "os.utime"}
_recording: list[tuple[str, str]] | None = None
_hook_installed = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _recording is None or event not in _WATCHED:
        return
    paths = args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]
    for path in paths:
        if isinstance(path, str | bytes | os.PathLike):
            _recording.append((event, os.fsdecode(path)))


@contextmanager
def recording() -> Iterator[list[tuple[str, str]]]:
    """Every path the code under test opens, creates, renames, links or removes.

    Audit hooks cannot be removed; this one is installed once and records only inside
    this context manager.
    """
    global _recording, _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)
        _hook_installed = True
    events: list[tuple[str, str]] = []
    _recording = events
    try:
        yield events
    finally:
        _recording = None


def _snapshot(top: Path, skip: tuple[Path, ...]) -> dict[str, tuple[int, int, str]]:
    """(mode, size, content-or-link) of everything under ``top`` outside ``skip``."""
    out: dict[str, tuple[int, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        for entry in [*dirnames, *filenames]:
            path = here / entry
            st_ = path.lstat()
            if path.is_symlink():
                detail = os.readlink(path)
            elif path.is_file():
                detail = sha256_hex(path.read_bytes())
            else:
                detail = ""
            out[str(path.relative_to(top))] = (st_.st_mode, st_.st_size, detail)
    return out


class Sandbox:
    """A pool, a caller's directory and a mirror, with bait all around them."""

    def __init__(self, top: Path) -> None:
        self.top = top
        self.pool_root = top / "pool"
        self.into = top / "caller" / "into"
        self.mirror = top / "mirror"
        self.outside = top / "outside"
        for directory in (self.into, self.mirror, self.outside / "sub"):
            directory.mkdir(parents=True)
        (top / "sentinel").write_bytes(DATA)
        (self.outside / "sentinel").write_bytes(DATA)
        (self.outside / "sub" / "k.cubin").write_bytes(DATA)
        # Symlinks out of the caller's directory and the mirror: a name that walks
        # through them must not carry a write or a read outside.
        os.symlink(self.outside, self.into / "escape")
        os.symlink(self.outside, self.mirror / "escape")
        (self.mirror / "sub").mkdir()
        (self.mirror / "sub" / "k.cubin").write_bytes(DATA)
        self.pool = ArtifactPool(self.pool_root)
        self.pool.put(DATA)
        self.loader = PooledLoader(
            self.pool, lambda *args: b"", origin=DirOrigin(self.mirror),
            cubin_dir=lambda: self.into,
        )
        self.allowed = (self.pool_root, self.into, self.mirror)

    def inside(self, path: str) -> bool:
        if not os.path.isabs(path):
            # Relative to a directory descriptor (the pool's fan-out reads): one plain
            # component, which cannot leave that directory.
            return "/" not in path and path not in ("", ".", "..")
        normal = Path(os.path.normpath(path))
        return any(normal.is_relative_to(root) for root in self.allowed)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("names-sandbox"))


@SANDBOX_FUZZ
@given(name=names | st.sampled_from(["escape/k.cubin", "escape/sub/k.cubin", "sub/k.cubin",
                                      "escape/new/k.cubin", "sub/k.cubin/x"]))
def test_name_handling_never_touches_anything_outside_its_directories(
    sandbox: Sandbox, name: str
) -> None:
    before = _snapshot(sandbox.top, sandbox.allowed)
    with recording() as events:
        try:
            artifact = Artifact(name, SHA, len(DATA))
        except ArtifactNameError:
            artifact = None
        if artifact is not None:
            sandbox.pool.remember([artifact])
            # A symlink or a file in the way is refused, which is the point.
            with suppress(PoolError):
                sandbox.pool.materialize(artifact, sandbox.into)
            with suppress(OriginError, IntegrityError):
                assert DirOrigin(sandbox.mirror).fetch(artifact) == DATA
        sandbox.loader(name, SHA)
    stray = [(event, path) for event, path in events if not sandbox.inside(path)]
    assert stray == []
    assert _snapshot(sandbox.top, sandbox.allowed) == before
