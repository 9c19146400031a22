"""Origins: where an artifact's bytes come from when no pool has them.

Every origin verifies what it delivers against the artifact's SHA-256; corrupt bytes
are never returned. :class:`HttpOrigin` (in :mod:`distcache.origins._http`) talks to a
CDN or mirror, :class:`DirOrigin` reads a local or shared mirror directory, and
:class:`OriginChain` tries several in order. :func:`open_origin` turns the
``DISTCACHE_ORIGIN`` syntax (comma-separated URLs and directories) into one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast, runtime_checkable
from urllib.parse import unquote, urlsplit

from distcache.artifact import Artifact, path_under
from distcache.errors import ConfigError, IntegrityError, OriginError
from distcache.origins._http import HttpOrigin, rewind

__all__ = ["DirOrigin", "HttpOrigin", "Origin", "OriginChain", "open_origin"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


@runtime_checkable
class Origin(Protocol):
    """Where bytes come from. Implementations verify before they return."""

    def describe(self) -> str:
        """A short label for logs and errors; never contains a secret."""
        ...

    def fetch(self, artifact: Artifact) -> bytes:
        """The artifact's verified bytes.

        Raises:
            IntegrityError: the bytes do not match ``artifact.sha256`` (or its size).
            OriginError: the origin cannot deliver it (``status=404``: it has none).
        """
        ...

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        """Stream the artifact into ``out``, hashing as it goes; return the byte count.
        On IntegrityError the caller discards what was written.

        Raises:
            IntegrityError: the bytes do not match.
            OriginError: the origin cannot deliver it.
        """
        ...


class _CountingWriter:
    """Counts what an origin writes into a stream that cannot be rewound."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.written = 0

    def write(self, data: bytes) -> int:
        count = self.raw.write(data)
        self.written += len(data)
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class DirOrigin:
    """Artifacts at ``path/<name>`` in a local or shared mirror directory.

    Symlinks inside the mirror are followed only while they stay inside it.

    Raises:
        OriginError: (from ``fetch``) missing file (``status=404``), a symlink leaving
            the mirror, or an unreadable file.
        IntegrityError: (from ``fetch``) the file's bytes do not match the artifact.
        ArtifactNameError: (from ``fetch``) the name is unsafe.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def describe(self) -> str:
        return f"dir:{self.path}"

    def __repr__(self) -> str:
        return f"DirOrigin({str(self.path)!r})"

    def fetch(self, artifact: Artifact) -> bytes:
        buffer = io.BytesIO()
        self.fetch_into(artifact, buffer)
        return buffer.getvalue()

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        candidate = path_under(self.path, artifact.name)
        root = self.path.resolve()
        try:
            real = candidate.resolve(strict=True)
        except FileNotFoundError:
            raise OriginError(
                f"{artifact.name} is not in mirror {self.path} (looked for {candidate}); "
                "add it to the mirror or put another origin after this one",
                url=str(candidate), status=404, name=artifact.name,
            ) from None
        except (OSError, RuntimeError) as exc:
            raise OriginError(
                f"cannot resolve {candidate} in mirror {self.path}: {exc}",
                url=str(candidate), status=None, name=artifact.name,
            ) from exc
        if not real.is_relative_to(root):
            raise OriginError(
                f"refused {candidate}: it is a symlink to {real}, outside mirror {root}; "
                "mirrors must hold their files (or links within themselves)",
                url=str(candidate), status=None, name=artifact.name,
            )
        digest = hashlib.sha256()
        count = 0
        limit = artifact.size
        try:
            # O_NONBLOCK: a FIFO planted in the mirror must not hang the open.
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as src:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OriginError(
                        f"{candidate} in mirror {self.path} is not a regular file",
                        url=str(candidate), status=None, name=artifact.name)
                # Read at most one byte past a declared size: a huge (or sparse) file
                # in the mirror is refused without reading it all, and nothing past
                # the declared size reaches ``out``.
                while chunk := src.read(_CHUNK if limit is None else
                                        min(_CHUNK, limit + 1 - count)):
                    count += len(chunk)
                    digest.update(chunk)
                    if limit is not None and count > limit:
                        break
                    out.write(chunk)
        except IsADirectoryError as exc:
            raise OriginError(f"{candidate} in mirror {self.path} is a directory, not a file",
                              url=str(candidate), status=None, name=artifact.name) from exc
        except OSError as exc:
            raise OriginError(f"cannot read {candidate} in mirror {self.path}: {exc}",
                              url=str(candidate), status=None, name=artifact.name) from exc
        actual = digest.hexdigest()
        if actual != artifact.sha256 or (limit is not None and count != limit):
            size_note = ""
            if limit is not None and count != limit:
                found = f"over {limit}" if count > limit else str(count)
                size_note = f" (size {found}, expected {limit})"
            raise IntegrityError(
                f"sha256 mismatch for {artifact.name} in mirror {self.path}{size_note}: "
                f"expected {artifact.sha256}, got {actual}; repair or remove {candidate}",
                sha256=artifact.sha256, actual=actual, source=str(candidate),
            )
        return count


class OriginChain:
    """Try origins in order; the first that delivers verified bytes wins.

    An ``OriginError`` or ``IntegrityError`` from one origin is logged and the next
    is tried. When every origin fails, an ``OriginError`` lists each failure;
    ``status`` is 404 when every origin answered 404, and ``failures`` holds
    ``(origin, message)`` pairs.

    Raises:
        ConfigError: no origins.
    """

    def __init__(self, origins: Sequence[Origin]) -> None:
        if not origins:
            raise ConfigError("an origin chain needs at least one origin",
                              variable="origins", value=())
        self.origins: tuple[Origin, ...] = tuple(origins)

    def describe(self) -> str:
        return " -> ".join(o.describe() for o in self.origins)

    def __repr__(self) -> str:
        return f"OriginChain({self.describe()!r})"

    def fetch(self, artifact: Artifact) -> bytes:
        buffer = io.BytesIO()
        self.fetch_into(artifact, buffer)
        return buffer.getvalue()

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        start = out.tell() if out.seekable() else None
        counted = _CountingWriter(out)
        failures: list[tuple[str, str]] = []
        statuses: list[int | None] = []
        for index, origin in enumerate(self.origins):
            counted.written = 0
            try:
                return origin.fetch_into(artifact, out if start is not None else cast(BinaryIO, counted))
            except (OriginError, IntegrityError) as exc:
                failures.append((origin.describe(), exc.message))
                statuses.append(getattr(exc, "status", None))
                if not rewind(out, start) and counted.written:
                    break  # bytes already went into a stream that cannot be rewound
                if index < len(self.origins) - 1:
                    logger.warning("origin %s failed for %s (%s); trying %s",
                                   origin.describe(), artifact.name, exc.message,
                                   self.origins[index + 1].describe())
        listed = "; ".join(f"[{label}] {message}" for label, message in failures)
        all_missing = len(statuses) == len(self.origins) and all(s == 404 for s in statuses)
        raise OriginError(
            f"no origin could deliver {artifact.name} (sha256 {artifact.sha256}), "
            f"tried {len(failures)} of {len(self.origins)}: {listed}",
            url=self.describe(), status=404 if all_missing else None,
            name=artifact.name, failures=failures,
        )


def _open_one(spec: str) -> Origin:
    text = spec.strip()
    if not text:
        raise ConfigError("empty origin; give a URL or a directory", variable="origin", value=spec)
    scheme = urlsplit(text).scheme.lower()
    if scheme in ("http", "https"):
        return HttpOrigin(text)
    if scheme == "file":
        return DirOrigin(unquote(urlsplit(text).path))
    if "://" in text:
        raise ConfigError(
            f"origin {text.split('://', 1)[0]}://... is not supported; use http(s):// "
            "or a directory path", variable="origin", value=text.split("://", 1)[0])
    return DirOrigin(text)


def open_origin(spec: str | Origin | Sequence[str | Origin]) -> Origin:
    """An origin from a spec: an ``http(s)://`` URL -> :class:`HttpOrigin`, a path or
    ``file://`` URL -> :class:`DirOrigin`, an Origin as is; a comma-separated string
    or a sequence -> :class:`OriginChain` (a single entry is returned unwrapped).

    Raises:
        ConfigError: an empty spec or an unsupported scheme.
    """
    items: list[Origin] = []
    specs: Sequence[str | Origin] = [spec] if isinstance(spec, str) or not isinstance(
        spec, Sequence) else spec
    for item in specs:
        if isinstance(item, str):
            parts = [p for p in item.split(",") if p.strip()]
            if not parts:
                raise ConfigError("empty origin; give a URL or a directory",
                                  variable="origin", value=item)
            items.extend(_open_one(p) for p in parts)
        elif isinstance(item, Origin):
            items.append(item)
        else:
            raise ConfigError(f"not an origin: {item!r}", variable="origin", value=repr(item))
    if not items:
        raise ConfigError("no origin given; pass a URL or a directory, or set DISTCACHE_ORIGIN",
                          variable="origin", value="")
    return items[0] if len(items) == 1 else OriginChain(items)
