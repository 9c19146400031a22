"""Artifacts: a name (an untrusted label) and the SHA-256 of its bytes.

Names come from manifests, engines and the network, so they are validated as hostile
input before they touch a filesystem: see :func:`validate_name`.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from distcache._record import Record
from distcache.errors import ArtifactNameError, ConfigError, IntegrityError, ManifestError

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_NAME_BYTES",
    "MAX_SEGMENT_BYTES",
    "Artifact",
    "check_sha256",
    "decode_manifest",
    "manifest_text",
    "merge_manifests",
    "parse_checksums",
    "path_under",
    "read_manifest",
    "sha256_hex",
    "validate_name",
    "verify_bytes",
]

MAX_NAME_BYTES = 1024
MAX_SEGMENT_BYTES = 255
#: The most :func:`read_manifest` reads: far above a real manifest (FlashInfer's whole
#: set is a few MiB), a bound on what a wrong path (``/dev/zero``) makes each rank load.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
# The characters of an untrusted name or line a message quotes (either may be huge).
_QUOTED_CHARS = 120
# \Z, not $: "$" also matches before a trailing newline, which would let "<sha>\n"
# through into object paths and newline-framed logs.
_SHA_RE = re.compile(r"[0-9a-f]{64}\Z")
# Control, format (zero-width, bidi overrides), surrogate and private-use characters
# have no place in a kernel's file name and are the usual material of spoofing. Line
# and paragraph separators (U+2028/U+2029) split lines for str.splitlines(), so a name
# holding one would not survive a manifest or a log.
_BAD_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
# Characters that render as a path separator without being one. NFKC folds the
# fullwidth and small forms (U+FF0F, U+FF3C, U+FE68) to ASCII; these it leaves alone.
# A name that looks like "a/../b" in a log or a web UI must not be a different path
# from the one it shows, and servers that fold Unicode (some CDNs, SMB) would see one.
_SEPARATOR_LOOKALIKES = frozenset("\u2215\u2044\u29f8\u2216\u29f5\u29f9\u2571\u2572")
# The names real manifests hold (ASCII letters, digits and a few punctuation marks in
# segments of at most 255 bytes that are not dots only) pass every rule below by
# construction: ASCII is NFC and folds to itself, and the set has no control
# character, space, backslash or '*'. One regular expression accepts them; anything
# else takes the rule-by-rule path. A family of 16,000 kernels is validated in
# milliseconds instead of seconds.
_FAST_SEGMENT = r"(?!\.+(?:/|\Z))[A-Za-z0-9_.+=,@%~-]{1,255}"
_FAST_NAME = re.compile(rf"{_FAST_SEGMENT}(?:/+{_FAST_SEGMENT})*")
_SLASHES = re.compile(r"/{2,}")
# A manifest line (its "\r" ending dropped) whose digest and name need no further
# checks: the name matches _FAST_NAME, which no separator character starts, so
# _fields in parse_checksums would find the same two. Any other line takes that path.
_FAST_LINE = re.compile(
    rf"\s*([0-9a-fA-F]{{64}})[ \t][ *]?({_FAST_SEGMENT}(?:/+{_FAST_SEGMENT})*)")


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def check_sha256(sha256: object) -> str:
    """Return ``sha256`` if it is 64 lowercase hex characters.

    Raises:
        ValueError: it is not.
    """
    if not isinstance(sha256, str) or not _SHA_RE.match(sha256):
        raise ValueError(f"sha256 must be 64 lowercase hex characters, got {_quoted(sha256)}")
    return sha256


def _quoted(text: object) -> str:
    """``repr(text)``, cut to :data:`_QUOTED_CHARS` characters of it for a message."""
    if isinstance(text, str) and len(text) > _QUOTED_CHARS:
        return f"{text[:_QUOTED_CHARS]!r}... ({len(text)} characters)"
    shown = repr(text)
    return shown if len(shown) <= _QUOTED_CHARS else f"{shown[:_QUOTED_CHARS]}..."


def collapse_slashes(name: str) -> str:
    """``name`` with each run of ``/`` made one, as :func:`validate_name` names it."""
    return name if "//" not in name else _SLASHES.sub("/", name)


def validate_name(name: object) -> str:
    """Return the normalised name, or raise.

    Rejected: non-strings, empty names, absolute paths, ``.``/``..`` segments,
    backslashes, NUL and other control or format characters, line separators, empty
    segments (a trailing ``/``), names over 1024 bytes or with a segment over 255
    bytes. Also rejected, because they display as something they are not or do not
    survive a ``sha256sum`` manifest: names not in Unicode NFC form, characters that
    look like ``/`` or ``\\`` (fullwidth solidus, division slash ...), segments that
    look like dots only (``...``, dot leaders, fullwidth full stops), segments with
    leading or trailing whitespace, and a leading ``*`` (sha256sum's binary marker).
    Runs of ``/`` inside a name (FlashInfer joins paths with ``//``) collapse to one.

    Raises:
        ArtifactNameError: the name is unsafe; ``reason`` says why.
    """
    if type(name) is str and len(name) <= MAX_NAME_BYTES and _FAST_NAME.fullmatch(name):
        return collapse_slashes(name)
    return _validate_slowly(name)


def _validate_slowly(name: object) -> str:
    """:func:`validate_name`, one rule at a time (and the reason for a rejection)."""

    def reject(reason: str) -> ArtifactNameError:
        return ArtifactNameError(
            f"artifact name {_quoted(name)} rejected: {reason}", name=name, reason=reason
        )

    if not isinstance(name, str):
        raise reject("not a string")
    if not name:
        raise reject("empty")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise reject(f"longer than {MAX_NAME_BYTES} bytes")
    if name.startswith("/"):
        raise reject("absolute path")
    if "\\" in name:
        raise reject("backslash")
    for ch in name:
        if unicodedata.category(ch) in _BAD_CATEGORIES:
            raise reject(f"control or format character U+{ord(ch):04X}")
        if ch in _SEPARATOR_LOOKALIKES:
            raise reject(f"U+{ord(ch):04X} looks like a path separator")
    if name.startswith("*"):
        raise reject("leading '*' (sha256sum's binary-mode marker)")
    if not unicodedata.is_normalized("NFC", name):
        # Two spellings of one visible name would be two files here and one file on a
        # normalising filesystem (macOS, ZFS with normalization=formD).
        raise reject("not in Unicode NFC form")
    normalised = _SLASHES.sub("/", name)
    segments = normalised.split("/")
    for segment in segments:
        if segment == "":
            raise reject("empty path segment")
        if segment in (".", ".."):
            raise reject(f"'{segment}' segment")
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise reject(f"a segment is longer than {MAX_SEGMENT_BYTES} bytes")
        if segment != segment.strip():
            # Manifests strip it, and Windows/SMB drop trailing spaces (".. " is "..").
            raise reject(f"segment {segment!r} has leading or trailing whitespace")
        folded = unicodedata.normalize("NFKC", segment)
        if "/" in folded or "\\" in folded:
            raise reject(f"segment {segment!r} holds a character that folds to '/' or '\\'")
        if set(folded) == {"."}:
            raise reject(f"segment {segment!r} is (or folds to) dots only")
    return normalised


def path_under(root: Path, name: str) -> Path:
    """``root / name`` for a validated name, checked to stay under ``root``.

    Raises:
        ArtifactNameError: the name is unsafe.
    """
    clean = validate_name(name)
    path = root.joinpath(*clean.split("/"))
    # Validation already forbids escapes; this is the belt to its braces.
    if not path.is_relative_to(root):
        raise ArtifactNameError(
            f"artifact name {_quoted(name)} escapes {root}", name=name, reason="escapes root"
        )
    return path


class Artifact(Record):
    """A named blob identified by its SHA-256.

    ``name`` is normalised (doubled ``//`` collapse); ``size`` is optional and, when
    given, checked on every transfer.

    Raises:
        ArtifactNameError: the name is unsafe.
        ValueError: the sha256 is not 64 lowercase hex characters, or size < 0.
    """

    _FIELDS = ("name", "sha256", "size")
    __slots__ = _FIELDS
    name: str
    sha256: str
    size: int | None

    def __init__(self, name: str, sha256: str, size: int | None = None) -> None:
        name = validate_name(name)
        check_sha256(sha256)
        if size is not None and (not isinstance(size, int) or size < 0):
            raise ValueError(f"size of {name} must be a non-negative int, got {size!r}")
        _set_name(self, name)
        _set_sha256(self, sha256)
        _set_size(self, size)


def _checked(name: str, sha256: str) -> Artifact:
    """An :class:`Artifact` of a name and digest the caller has already validated
    (``validate_name(name) == name`` and ``check_sha256(sha256)``), without checking
    them again."""
    artifact: Artifact = _new(Artifact)
    _set_name(artifact, name)
    _set_sha256(artifact, sha256)
    _set_size(artifact, None)
    return artifact


# The slots' own setters: Record's __setattr__ refuses, these do not.
_new = object.__new__
_set_name = Artifact.__dict__["name"].__set__
_set_sha256 = Artifact.__dict__["sha256"].__set__
_set_size = Artifact.__dict__["size"].__set__


def verify_bytes(data: bytes | bytearray | memoryview, sha256: str, *, source: str = "") -> None:
    """Check ``data`` against ``sha256``.

    Raises:
        IntegrityError: the digest differs.
    """
    actual = sha256_hex(data)
    if actual != sha256:
        where = f" from {source}" if source else ""
        raise IntegrityError(
            f"sha256 mismatch{where}: expected {sha256}, got {actual}",
            sha256=sha256,
            actual=actual,
            source=source,
        )


def _at(source: str | None, lineno: int) -> str:
    """Where a manifest line is, for messages: ``FILE:LINE`` or ``line LINE``."""
    return f"{source}:{lineno}" if source else f"line {lineno}"


def _fields(line: str) -> tuple[str, str] | None:
    """The digest (lower case) and the name of a manifest line as ``sha256sum`` writes
    it: the digest, a space (or a tab), then a space or ``*`` (its text or binary mode;
    a single space also reads), and the name exactly as written up to the end of the
    line, spaces included: a name that begins or ends with one is then refused by the
    name rules, never read as another file's. Leading whitespace is skipped; None
    when the line has no such fields."""
    body = line.lstrip()
    digest, rest = body[:64].lower(), body[65:]
    if not _SHA_RE.match(digest) or body[64:65] not in (" ", "\t"):
        return None
    name = rest[1:] if rest[:1] in (" ", "*") else rest
    return (digest, name) if name else None


def parse_checksums(text: str, prefix: str = "", *, source: str | None = None) -> list[Artifact]:
    """Parse ``sha256sum`` output (``<sha>  <name>`` or ``<sha> *<name>`` per line, the
    name as written: see :func:`_fields`).

    A leading byte order mark, blank lines, ``#`` comments and "\\r" line ends are
    skipped. ``prefix`` is joined in front of every name. The same name listed twice
    with the same digest is kept once. ``source`` (the file the text came from) leads every error message,
    as ``FILE:LINE``.

    Raises:
        ManifestError: a malformed line, or one name with two digests (with the line
            number).
        ArtifactNameError: an unsafe name (with the line number in the message).
    """
    out: dict[str, Artifact] = {}
    # Lines are "\n"-framed (as sha256sum writes them); str.splitlines() would also
    # split on U+2028, U+0085 and friends and report the wrong line number.
    for lineno, raw in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        line = raw.removesuffix("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fast = _FAST_LINE.fullmatch(line)
        if fast is not None and not prefix and len(fast[2]) <= MAX_NAME_BYTES:
            digest, name = fast[1].lower(), collapse_slashes(fast[2])
            previous = out.get(name)
            if previous is None:
                out[name] = _checked(name, digest)
                continue
            if previous.sha256 == digest:
                continue
            # Two digests: the general path below words the error.
        fields = _fields(line)
        if fields is None:
            raise ManifestError(
                f"{_at(source, lineno)}: expected '<64 hex sha256>  <name>', got {_quoted(raw)}",
                line=lineno, text=raw, source=source)
        digest, name = fields
        full = f"{prefix.rstrip('/')}/{name}" if prefix else name
        try:
            artifact = Artifact(full, digest)
        except ArtifactNameError as exc:
            raise ArtifactNameError(
                f"{_at(source, lineno)}: {exc.message}", name=full,
                reason=getattr(exc, "reason", ""), line=lineno,
            ) from None
        previous = out.get(artifact.name)
        if previous is not None and previous.sha256 != digest:
            raise ManifestError(
                f"{_at(source, lineno)}: {artifact.name} is listed with two digests "
                f"({previous.sha256} and {digest})", line=lineno, text=raw, source=source)
        out[artifact.name] = artifact
    return list(out.values())


def decode_manifest(data: bytes, *, source: str | None = None) -> str:
    """The text of a manifest's bytes (``source``: the file they came from, for
    the message).

    Raises:
        ManifestError: the bytes are not UTF-8 (with the line number).
    """
    try:
        return data.decode("utf-8-sig")  # a leading byte order mark is no part of the text
    except UnicodeDecodeError as exc:
        start = exc.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        line = data[:start].count(b"\n") + 1
        raise ManifestError(
            f"{_at(source, line)}: the manifest is not UTF-8 (byte {start})",
            line=line, text=data.split(b"\n")[line - 1][:120].decode("utf-8", "replace"),
            source=source,
        ) from None


def read_manifest(path: str | os.PathLike[str], prefix: str = "") -> list[Artifact]:
    """Parse the ``sha256sum``-format manifest file at ``path``.

    Raises:
        ConfigError: the file cannot be read, or holds more than
            :data:`MAX_MANIFEST_BYTES` (names it and the reason).
        ManifestError: a malformed line or bytes that are not UTF-8 (the message
            starts with ``PATH:LINE``; ``source`` is the path).
        ArtifactNameError: an unsafe name (the message starts with ``PATH:LINE``).
    """
    where = Path(path)
    try:
        from distcache._bounded import _read_at_most  # a manifest read from a file

        data = _read_at_most(where, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise ConfigError(
            f"cannot read manifest {where}: {exc.strerror or exc}", variable="manifest",
            value=str(where),
        ) from exc
    return parse_checksums(decode_manifest(data, source=str(where)), prefix, source=str(where))


def manifest_text(artifacts: Iterable[Artifact]) -> str:
    """The ``sha256sum``-format text of ``artifacts`` (inverse of parse_checksums)."""
    return "".join(f"{a.sha256}  {a.name}\n" for a in artifacts)


def merge_manifests(parts: Iterable[tuple[str, Iterable[Artifact]]]) -> list[Artifact]:
    """The union of ``(source, artifacts)`` parts, sorted by name: the one merge rule.

    A name listed again with the same digest is kept once (its first listing wins, so
    a ``size`` given there is kept); a name listed with two digests is an error that
    names both sources. Order does not matter, so every rank that merges the same
    parts gets the same list.

    Raises:
        ManifestError: one name with two digests, or a part that is not a list of
            :class:`Artifact` (naming its source).
    """
    merged: dict[str, tuple[Artifact, str]] = {}
    for source, artifacts in parts:
        for artifact in artifacts if isinstance(artifacts, Iterable) else [artifacts]:
            if not isinstance(artifact, Artifact):
                raise ManifestError(f"{source} lists {_quoted(artifact)}, which is not an "
                                    "Artifact: a manifest is a list of Artifact", line=0,
                                    text=_quoted(artifact), source=source)
            previous = merged.get(artifact.name)
            if previous is None:
                merged[artifact.name] = (artifact, source)
            elif previous[0].sha256 != artifact.sha256:
                raise ManifestError(
                    f"{artifact.name} is listed with two digests: {previous[0].sha256} "
                    f"({previous[1]}) and {artifact.sha256} ({source}); the record or "
                    "manifest is stale",
                    line=0,
                    text=artifact.name,
                )
    return [artifact for _, (artifact, _source) in sorted(merged.items())]
