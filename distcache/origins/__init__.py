"""Origins: where artifact bytes come from when no pool has them.

Every origin verifies what it delivers against the artifact's SHA-256; corrupt bytes
are never returned. An origin that has no such artifact raises
:class:`~distcache.errors.ArtifactNotFound` (an ``OriginError``), which callers test
by type, never by an HTTP status.

:func:`open_origin` turns the ``DISTCACHE_ORIGIN`` syntax (comma-separated entries, or
a sequence of entries and origins) into one origin; several become an
:class:`OriginChain`, tried in order. Each entry's URL scheme picks its factory in the
scheme table (``distcache.origins._open.SCHEMES``):

============  =====================================  ==============================
scheme        origin                                 example
============  =====================================  ==============================
``http``      :class:`HttpOrigin` (the whole URL)    ``http://mirror.local/cubins``
``https``     :class:`HttpOrigin` (the whole URL)    ``https://cdn.example/cubins``
``file``      :class:`DirOrigin` (the URL's path)    ``file:///shared/mirror``
(none)        :class:`DirOrigin` (an existing dir)   ``/shared/mirror``
============  =====================================  ==============================

Any other ``scheme://``, or a spec without one that is not an existing directory, is a
:class:`~distcache.errors.ConfigError` naming the spec (and the known schemes).

Credentials belong to a host (:class:`Credentials`): ``DISTCACHE_ORIGIN_TOKEN`` goes to
the host of the first http(s) entry of ``DISTCACHE_ORIGIN`` only,
``DISTCACHE_ORIGIN_TOKENS`` binds one token per host, and no token follows a redirect
to another scheme, host or port. A new kind of origin (S3, a model hub) is one private module
with a class over :class:`BaseOrigin` (implement ``describe`` and ``fetch_into``) and
one entry in the table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distcache.origins._base import BaseOrigin, Origin
from distcache.origins._chain import OriginChain
from distcache.origins._credentials import Credentials
from distcache.origins._directory import DirOrigin
from distcache.origins._open import open_origin
from distcache.origins._stopper import Interrupted, Stopper

if TYPE_CHECKING:
    from distcache.origins._http import HttpOrigin

__all__ = [
    "BaseOrigin",
    "Credentials",
    "DirOrigin",
    "HttpOrigin",
    "Interrupted",
    "Origin",
    "OriginChain",
    "Stopper",
    "open_origin",
]


def __getattr__(name: str) -> Any:
    # HttpOrigin is loaded when first named, and requests and urllib3 with its first
    # request: a rank that downloads nothing never imports them.
    if name == "HttpOrigin":
        from distcache.origins._http import HttpOrigin

        return HttpOrigin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
