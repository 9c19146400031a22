"""The former single-module home of the origins, kept as an import path.

Import from :mod:`distcache.origins` instead; nothing is defined here.
"""

from __future__ import annotations

from distcache.origins._base import Origin as Origin
from distcache.origins._chain import OriginChain as OriginChain
from distcache.origins._directory import DirOrigin as DirOrigin
from distcache.origins._http import HttpOrigin as HttpOrigin
from distcache.origins._open import open_origin as open_origin
