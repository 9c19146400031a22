"""checksums.txt and the pool's label log are parsed as hostile text.

``parse_checksums`` returns valid artifacts or raises ``ManifestError`` /
``ArtifactNameError`` carrying the 1-based line number; it never raises anything
else, whatever the lines hold. What ``manifest_text`` writes, it reads back
unchanged. Garbage appended to ``names.log`` or ``journal.log`` is skipped, never
misread as a label or an object.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcache.artifact import (
    Artifact,
    manifest_text,
    parse_checksums,
    sha256_hex,
    validate_name,
)
from distcache.errors import ArtifactNameError, ManifestError
from distcache.integrations.flashinfer._warm import _parse_family
from distcache.store._pool import ArtifactPool

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow])

SHA_A = sha256_hex(b"a")
SHA_B = sha256_hex(b"b")

hex_digests = st.text("0123456789abcdef", min_size=64, max_size=64)
safe_segments = st.text(
    st.characters(codec="utf-8", exclude_characters="/\\"), min_size=1, max_size=12)
# Names that validate_name accepts, drawn from all of Unicode and then filtered.
valid_names = st.lists(safe_segments, min_size=1, max_size=4).map("/".join).filter(
    lambda n: _accepted(n))


def _accepted(name: str) -> bool:
    try:
        return validate_name(name) == name
    except ArtifactNameError:
        return False


valid_lines = st.builds(
    lambda sha, sep, name: f"{sha}{sep}{name}",
    hex_digests | hex_digests.map(str.upper),
    st.sampled_from(["  ", " *", " ", "\t", "  *"]),
    valid_names,
)
hostile_lines = st.one_of(
    st.text(max_size=90),
    st.builds(lambda sha, rest: sha + rest, hex_digests, st.text(max_size=30)),
    st.sampled_from([
        "", "#", "# comment", "   ", "\r", f"{SHA_A}", f"{SHA_A}  ", f"{SHA_A}  *",
        f"{SHA_A}  ../etc/passwd", f"{SHA_A}  /abs", f"{SHA_A}  a\x00b", f"{SHA_A[:-1]}  a",
        f"{SHA_A}x  a", f"{SHA_A}  a/./b", f"{SHA_A}  a\u2028b", f"{SHA_A}  a\x85b",
        f"{SHA_A}  e\u0301", f"{SHA_A}  \uff0e\uff0e/x", f"{SHA_A}\u3000a",
        f"{SHA_A}  a\\b", "g" * 64 + "  a", f"{SHA_A}  " + "x" * 300,
    ]),
)


def _check_outcome(text: str, prefix: str = "") -> None:
    lines = text.split("\n")
    try:
        artifacts = parse_checksums(text, prefix)
    except (ManifestError, ArtifactNameError) as exc:
        line = getattr(exc, "line", None)
        assert isinstance(line, int)
        assert 1 <= line <= len(lines)
        assert exc.message.startswith(f"line {line}: ")
        return
    names = [a.name for a in artifacts]
    assert len(names) == len(set(names))
    for artifact in artifacts:
        assert validate_name(artifact.name) == artifact.name
        assert len(artifact.sha256) == 64 and artifact.sha256 == artifact.sha256.lower()


@FUZZ
@given(st.lists(valid_lines | hostile_lines, max_size=12), st.sampled_from(["\n", "\r\n"]))
def test_any_lines_give_artifacts_or_a_typed_error_with_the_line(
    lines: list[str], newline: str
) -> None:
    _check_outcome(newline.join(lines))


@FUZZ
@given(st.lists(valid_lines, min_size=1, max_size=6), st.data())
def test_mutated_manifests_give_artifacts_or_a_typed_error(
    lines: list[str], data: st.DataObject
) -> None:
    text = "\n".join(lines)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        edit = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        char = data.draw(st.characters(codec="utf-8") | st.sampled_from(
            ["\n", "/", "..", "\x00", "*", " ", "\u2028"]))
        if edit == "insert":
            text = text[:at] + char + text[at:]
        elif edit == "delete":
            text = text[:at] + text[at + 1:]
        else:
            text = text[:at] + char + text[at + 1:]
    _check_outcome(text)
    _check_outcome(text, prefix=data.draw(st.sampled_from(["", "pin/", "pin//x", "/", ".."])))


@FUZZ
@given(st.dictionaries(valid_names, hex_digests, max_size=8))
def test_manifest_text_reads_back_unchanged(listing: dict[str, str]) -> None:
    artifacts = [Artifact(name, sha) for name, sha in listing.items()]
    assert parse_checksums(manifest_text(artifacts)) == artifacts


@pytest.mark.parametrize(
    ("text", "line", "error"),
    [
        # U+2028 used to split the line in two: the error named line 2 of a one-line file.
        (f"{SHA_A}  a\u2028b", 1, ArtifactNameError),
        (f"# header\x85still the comment\n{SHA_A}  ../x", 2, ArtifactNameError),
        (f"{SHA_A}  a\n{SHA_B}  a", 2, ManifestError),
        (f"{SHA_A}  ok\nnot a line", 2, ManifestError),
        (f"{SHA_A}\n", 1, ManifestError),
        (f"{SHA_A}  e\u0301.cubin", 1, ArtifactNameError),
    ],
)
def test_errors_name_the_line_as_a_text_editor_counts_it(
    text: str, line: int, error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        parse_checksums(text)
    assert info.value.line == line  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["*star.cubin", "trailing ", " leading", "a\u2028b"])
def test_names_that_a_manifest_cannot_carry_are_rejected_up_front(name: str) -> None:
    # Each of these used to be accepted, written by manifest_text, and read back as a
    # different name (or not at all).
    with pytest.raises(ArtifactNameError):
        Artifact(name, SHA_A)


def test_crlf_and_binary_markers_are_understood() -> None:
    text = f"{SHA_A.upper()} *a.cubin\r\n\r\n# note\r\n{SHA_B}  dir//b.cubin\r\n"
    assert parse_checksums(text, "pin") == [
        Artifact("pin/a.cubin", SHA_A), Artifact("pin/dir/b.cubin", SHA_B)]


@FUZZ
@given(st.binary(max_size=200))
def test_family_manifest_bytes_parse_or_raise_a_manifest_error(data: bytes) -> None:
    # A pinned manifest that is not UTF-8 used to escape as UnicodeDecodeError.
    checksums = Artifact("pin/fmha/checksums.txt", sha256_hex(data))
    try:
        artifacts = _parse_family(checksums, data)
    except (ManifestError, ArtifactNameError) as exc:
        assert getattr(exc, "line", 0) >= 1
        return
    assert all(a.name.startswith("pin/fmha/") for a in artifacts)


def test_non_utf8_family_manifest_is_a_manifest_error_with_its_line() -> None:
    data = f"{SHA_A}  a.cubin\n{SHA_B}  b\xff.cubin\n".encode("latin-1")
    with pytest.raises(ManifestError) as info:
        _parse_family(Artifact("pin/checksums.txt", sha256_hex(data)), data)
    assert info.value.line == 2  # type: ignore[attr-defined]


# -- the pool's own logs --------------------------------------------------------------


@pytest.fixture(scope="module")
def log_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@FUZZ
@given(st.binary(max_size=300) | st.lists(
    st.sampled_from([f"{SHA_B} 00000000 evil/../x", f"{SHA_B} deadbeef ok.cubin",
                     f"{SHA_B} 1 2 3", SHA_B[:63], "\xff\xfe", SHA_B + "\r",
                     f"{SHA_B}\u2028", "\x00" * 10]),
    max_size=5).map(lambda lines: "\n".join(lines).encode("utf-8", "surrogateescape")))
def test_garbage_in_the_pool_logs_is_skipped_not_misread(log_base: Path, garbage: bytes) -> None:
    pool = ArtifactPool(Path(tempfile.mkdtemp(dir=log_base)))
    pool.remember([Artifact("good/a.cubin", SHA_A)])
    pool.put(b"a")
    for log in ("names.log", "journal.log"):
        with open(pool.root / log, "ab") as out:
            out.write(garbage)
    pool.remember([Artifact("good/b.cubin", SHA_B)])
    # A second process reads the logs from scratch.
    labels = ArtifactPool(pool.root).names()
    assert labels["good/a.cubin"] == SHA_A
    assert labels["good/b.cubin"] == SHA_B  # a label written after the garbage survives
    for name, sha in labels.items():
        assert validate_name(name) == name and len(sha) == 64
    shas, _cursor = pool.journal_since(0)
    assert SHA_A in shas
    assert all(len(s) == 64 and set(s) <= set("0123456789abcdef") for s in shas)


def test_names_log_tolerates_a_torn_label_between_good_ones(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.remember([Artifact("a.cubin", SHA_A)])
    with open(pool.root / "names.log", "ab") as out:
        out.write(f"{SHA_B} 0000".encode())  # a writer died mid-record
    pool.remember([Artifact("b.cubin", SHA_B)])
    assert pool.names() == {"a.cubin": SHA_A, "b.cubin": SHA_B}
