"""Integrations: how distcache plugs into a consumer of artifacts (FlashInfer, ...).

An :class:`Integration` says where its artifacts come from by default, which ones it
wants at start-up, how to put the pool behind its loader and take it away again, and
where an unmodified program looks for files. ``distcache.init(integrations=[...])``
installs exactly those (``integrations=()``: none); without the option it installs the
default set, FlashInfer when it is importable. Options of an integration are its own
(``FlashInfer(record=DIR)``), not ``init``'s. Nothing outside an integration's own
package reads its settings. An integration whose install reads nothing the start-up
prefetch brings may say so with a true ``install_beside_prefetch`` attribute: a
foreground ``init`` then installs it on a thread while the prefetch runs (one whose
install imports something that must be imported on the main thread says false).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from distcache.artifact import Artifact
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

__all__ = ["Integration"]


@runtime_checkable
class Integration(Protocol):
    """One consumer of artifacts. Every method is cheap and non-collective."""

    #: A short lower-case name for logs and ``--json`` output (``"flashinfer"``).
    name: str

    def available(self) -> bool:
        """True when the consumer is importable in this process."""
        ...

    def default_origin(self) -> str | None:
        """The origin spec to use when neither an argument nor ``DISTCACHE_ORIGIN``
        names one (FlashInfer: ``FLASHINFER_CUBINS_REPOSITORY``)."""
        ...

    def manifest(self) -> list[Artifact]:
        """Artifacts this integration wants in the pool at start-up (may be empty)."""
        ...

    def install(self, pool: ArtifactPool, origin: Origin | None) -> None:
        """Serve the consumer's lookups from ``pool`` (idempotent)."""
        ...

    def uninstall(self) -> None:
        """Undo :meth:`install` (idempotent)."""
        ...

    def materialize_dir(self) -> Path | None:
        """A writable directory where an unmodified consumer looks for files, or
        ``None`` when it has none."""
        ...
