"""What an origin is: the :class:`Origin` protocol and :class:`BaseOrigin`.

Anything with ``describe``, ``fetch`` and ``fetch_into`` is an origin (the protocol
is all the store and the collective rely on). The origins shipped here derive from
:class:`BaseOrigin`, which writes ``fetch`` once over ``fetch_into``, so a new origin
implements only the streaming read and its label.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from typing import BinaryIO, Protocol, runtime_checkable
from urllib.parse import SplitResult, urlsplit

from distcache._urls import redact_url
from distcache.artifact import Artifact
from distcache.errors import ConfigError


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
            ArtifactNotFound: the origin answered that it has no such artifact.
            OriginError: the origin cannot deliver it for another reason.
        """
        ...

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        """Stream the artifact into ``out``, hashing as it goes; return the byte count.
        On IntegrityError the caller discards what was written.

        Raises:
            IntegrityError: the bytes do not match.
            ArtifactNotFound: the origin answered that it has no such artifact.
            OriginError: the origin cannot deliver it for another reason.
        """
        ...


class BaseOrigin(ABC):
    """An origin written as a streaming read: subclasses implement :meth:`describe`
    and :meth:`fetch_into`; :meth:`fetch` collects the stream into bytes."""

    @abstractmethod
    def describe(self) -> str:
        """A short label for logs and errors; never contains a secret."""

    @abstractmethod
    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        """Stream the artifact into ``out``, verifying it; return the byte count.

        Raises:
            IntegrityError: the bytes do not match ``artifact.sha256`` (or its size).
            ArtifactNotFound: the origin answered that it has no such artifact.
            OriginError: the origin cannot deliver it for another reason.
        """

    def prepare(self) -> None:  # noqa: B027 (optional: nothing to set up by default)
        """Set up what fetching needs (an HTTP client, say) ahead of the first fetch,
        so that the first download does not wait for it; idempotent, and safe to
        call from another thread while fetches start. Nothing by default."""

    def fetch(self, artifact: Artifact) -> bytes:
        """The artifact's verified bytes.

        Raises:
            IntegrityError: the bytes do not match ``artifact.sha256`` (or its size).
            ArtifactNotFound: the origin answered that it has no such artifact.
            OriginError: the origin cannot deliver it for another reason.
        """
        buffer = io.BytesIO()
        self.fetch_into(artifact, buffer)
        return buffer.getvalue()


class Asked:
    """``origin``, noting whether it was asked for an artifact's bytes (``asked``): a
    pool asks its origin only for an object still missing once it holds the object's
    lock, so the caller of ``ArtifactPool.fetch`` learns whether the origin served it
    or another process had published it meanwhile."""

    def __init__(self, origin: Origin) -> None:
        self._origin = origin
        self.asked = False

    def describe(self) -> str:
        return self._origin.describe()

    def fetch(self, artifact: Artifact) -> bytes:
        self.asked = True
        return self._origin.fetch(artifact)

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        self.asked = True
        return self._origin.fetch_into(artifact, out)


def rewind(out: BinaryIO, start: int | None) -> bool:
    """Drop what a failed attempt wrote into ``out`` after offset ``start``; False
    when ``out`` cannot be rewound (``start`` is None)."""
    if start is None:
        return False
    out.seek(start)
    out.truncate()
    return True


def split_url(url: str, *, variable: str) -> SplitResult:
    """``urlsplit(url)``, once its port (when it names one) is known to be a number from
    1 to 65535 and its host readable (urlsplit raises a bare ValueError for these, and
    for the port only when it is asked for).

    Raises:
        ConfigError: a port that is not a number, 0 or out of range, or a broken IPv6
            literal; the message names the URL without its user-info and query.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        problem = "its host is malformed (an IPv6 address is written in brackets: [::1])"
    else:
        try:
            port = parts.port
        except ValueError:  # not a number, or over 65535
            port = 0
        if port != 0:
            return parts
        problem = "its port is not a number from 1 to 65535"
    shown = redact_url(url)
    raise ConfigError(f"origin {shown!r} is not a valid URL: {problem}",
                      variable=variable, value=shown)
