"""What a pool is to its callers: the :class:`Pool` protocol (and its
:class:`Identity`).

:class:`~distcache.store.ArtifactPool` implements it; the collective (downloads,
moves, discovery, sync) and the test stand-ins rely on nothing else. It is declared
once, here at the seam, so that a caller needing one more method adds it here and
every implementation is checked against the same list.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from distcache.artifact import Artifact

if TYPE_CHECKING:
    from distcache.origins import Origin


class Identity(Protocol):
    """Who a pool is, and how a collective proves that ranks see the same directory
    (see :class:`~distcache.store._identity.PoolIdentity`)."""

    @property
    def pool_id(self) -> str: ...
    def probe(self, name: str, token: str) -> AbstractContextManager[bool]: ...
    def sees(self, name: str, token: str) -> bool: ...
    def renew(self) -> str: ...
    def reload(self) -> str: ...


class Pool(Protocol):
    """A content-addressed store of verified artifact bytes (see
    :class:`~distcache.store.ArtifactPool` for what each method raises)."""

    @property
    def pool_id(self) -> str:
        """The pool's id: equal on every process that opens the same pool (and on a
        copy of it, until a collective finds the copy: ``identity``)."""
        ...

    @property
    def identity(self) -> Identity: ...

    def has(self, sha256: str) -> bool: ...
    def holding(self, shas: Iterable[str]) -> list[bool]: ...
    def get(self, sha256: str, *, trust_own: bool = False) -> bytes | None: ...
    def put(self, data: bytes | bytearray | memoryview, sha256: str | None = None) -> str: ...
    def download(self, artifact: Artifact, origin: Origin) -> int: ...
    def batch(self, *, wait: bool = True) -> AbstractContextManager[None]: ...
    def remember(self, artifacts: Iterable[Artifact]) -> None: ...
    def names(self) -> dict[str, str]: ...
    def journal_since(self, cursor: int = 0) -> tuple[list[str], int]: ...
