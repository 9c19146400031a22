"""Several origins tried in order (``DISTCACHE_ORIGIN=mirror,https://cdn``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, BinaryIO, cast

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.errors import (
    ArtifactNotFound,
    ConfigError,
    IntegrityError,
    OriginError,
    OriginUnreachable,
)
from distcache.origins._base import BaseOrigin, Origin, rewind

logger = get_logger(__name__)


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


class OriginChain(BaseOrigin):
    """Try origins in order; the first that delivers verified bytes wins.

    An ``OriginError`` or ``IntegrityError`` from one origin is logged and the next
    is tried. When every origin fails, the error lists each failure; it is an
    :class:`IntegrityError` when every origin either has no such artifact or served
    wrong bytes, and at least one served wrong bytes (the artifact is bad, not the
    origins: a batch goes on with the other artifacts), an :class:`ArtifactNotFound`
    when every origin answered that it has no such artifact, an
    :class:`OriginUnreachable` when every origin is unreachable, an ``OriginError``
    otherwise. The ``OriginError`` kinds hold ``(origin, message)`` pairs in
    ``failures``.

    An origin that raised ``OriginUnreachable`` (a refused connection, an unknown
    host) answers at once while it is down (see :class:`HttpOrigin`): the chain moves
    on to the next without a request, and warns once, not once per artifact.

    Raises:
        ConfigError: no origins.
    """

    def __init__(self, origins: Sequence[Origin]) -> None:
        if not origins:
            raise ConfigError("an origin chain needs at least one origin",
                              variable="origins", value=())
        self.origins: tuple[Origin, ...] = tuple(origins)
        # Indexes of the origins whose being down was logged; cleared when one delivers.
        self._warned: set[int] = set()

    def describe(self) -> str:
        return " -> ".join(o.describe() for o in self.origins)

    def __repr__(self) -> str:
        return f"OriginChain({self.describe()!r})"

    def prepare(self) -> None:
        """Prepare the first origin, the one every fetch asks first."""
        prepare = getattr(self.origins[0], "prepare", None)
        if prepare is not None:
            prepare()

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        """Stream the artifact from the first origin that delivers it into ``out``.

        A failed origin's bytes are truncated away before the next is tried when
        ``out`` is seekable; when it is not, the first failure after bytes were
        written ends the chain (the caller discards ``out``).

        Raises:
            IntegrityError: every origin lacked it or served wrong bytes, one at least
                wrong bytes (the message lists each origin's outcome).
            ArtifactNotFound: every origin answered that it has no such artifact.
            OriginError: no origin delivered it (the message lists each failure).
        """
        start = out.tell() if out.seekable() else None
        counted = _CountingWriter(out)
        failures: list[tuple[str, str]] = []
        missing = 0
        corrupt: list[IntegrityError] = []
        down: list[str] = []
        for index, origin in enumerate(self.origins):
            counted.written = 0
            try:
                count = origin.fetch_into(artifact, out if start is not None else cast(BinaryIO, counted))
            except (OriginError, IntegrityError) as exc:
                failures.append((origin.describe(), exc.message))
                missing += isinstance(exc, ArtifactNotFound)
                if isinstance(exc, IntegrityError):
                    corrupt.append(exc)
                # Whatever the failure, the failed origin's bytes go before the next is
                # asked (one cut off mid-body by a server gone down too): the next
                # origin verifies only the bytes it writes itself.
                if not rewind(out, start) and counted.written:
                    break  # bytes already went into a stream that cannot be rewound
                if isinstance(exc, OriginUnreachable):
                    down.append(f"{origin.describe()} ({getattr(exc, 'cause', None)})")
                    if index not in self._warned:
                        self._warned.add(index)
                        logger.warning("%s; skipping it while it is down",
                                       exc.message.split(";", 1)[0])
                    continue
                if index < len(self.origins) - 1:
                    logger.warning("origin %s failed for %s (%s); trying %s",
                                   origin.describe(), artifact.name, exc.message,
                                   self.origins[index + 1].describe())
            else:
                self._warned.discard(index)
                return count
        listed = "; ".join(f"[{label}] {message}" for label, message in failures)
        if len(down) == len(self.origins):
            raise OriginUnreachable(
                f"every origin is unreachable: {', '.join(down)}; check the URLs and that "
                "the servers are up",
                url=self.describe(), name=artifact.name, failures=failures,
                cause="; ".join(down))
        tried = (f"no origin could deliver {artifact.name} (sha256 {artifact.sha256}), "
                 f"tried {len(failures)} of {len(self.origins)}: {listed}")
        if corrupt and missing + len(corrupt) == len(self.origins):
            # Only this artifact is condemned: each origin lacks it or holds bad bytes.
            raise IntegrityError(
                f"{tried}; repair or remove the corrupt copies, or check the artifact's pin",
                sha256=artifact.sha256, actual=getattr(corrupt[0], "actual", None),
                source=self.describe(), name=artifact.name)
        error = ArtifactNotFound if missing == len(self.origins) else OriginError
        raise error(tried, url=self.describe(), name=artifact.name, failures=failures)
