"""The artifact pool: a content-addressed, SHA-256-verified store on one filesystem.

``ArtifactPool`` is the whole public surface; file I/O, the label log, locking and
maintenance sit behind it as private modules.
"""

from __future__ import annotations

from distcache.store._pool import ArtifactPool

__all__ = ["ArtifactPool"]
