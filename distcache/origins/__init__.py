"""Origins: where artifact bytes come from.

``open_origin`` turns a spec (a URL, a directory, or a list of either) into an
:class:`Origin`; every origin verifies what it returns against the artifact's SHA-256.
"""

from __future__ import annotations

from distcache.origins._http import HttpOrigin
from distcache.origins._origin import DirOrigin, Origin, OriginChain, open_origin

__all__ = ["DirOrigin", "HttpOrigin", "Origin", "OriginChain", "open_origin"]
