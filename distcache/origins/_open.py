"""From the ``DISTCACHE_ORIGIN`` syntax to an origin: :func:`open_origin`.

A spec's URL scheme picks its origin's factory in :data:`SCHEMES`; a spec without
``scheme://`` is a directory path, and must be an existing directory
(``127.0.0.1:8000`` is a server written without its scheme, not a mirror). Adding a
kind of origin is one module beside this one and one entry in the table. Each factory
gets the spec and the :class:`Credentials` in force, and takes only what is bound to
its own host.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import unquote, urlsplit

from distcache._urls import URL_SCHEME, redact_url
from distcache.config import settings
from distcache.errors import ConfigError
from distcache.origins._base import Origin, split_url
from distcache.origins._chain import OriginChain
from distcache.origins._credentials import Credentials
from distcache.origins._directory import DirOrigin


def _file_url(spec: str, credentials: Credentials) -> Origin:
    parts = urlsplit(spec)
    if parts.netloc.lower() not in ("", "localhost") or not parts.path:
        # file://cubins/fmha names host "cubins": read as /fmha (or, without a path,
        # as the working directory) it would serve another directory's files.
        raise ConfigError(
            f"origin {redact_url(spec)!r} is not a local file URL; write file:///absolute/path "
            "(three slashes) or give the directory path itself",
            variable="origin", value=redact_url(spec))
    path = unquote(parts.path)
    if not os.path.isdir(path):
        # A mistyped mirror path would answer every artifact "not found", for good.
        what = "a file" if os.path.exists(path) else "no such directory"
        raise ConfigError(
            f"origin {redact_url(spec)!r} is not an existing directory ({what}); give the "
            "file:// URL or the path of an existing mirror directory",
            variable="origin", value=redact_url(spec))
    return DirOrigin(path)


def _http_url(spec: str, credentials: Credentials) -> Origin:
    # requests is imported with the origin's first request, not with the package.
    from distcache.origins._http import HttpOrigin

    return HttpOrigin(spec, token=credentials.token_for(spec))


#: URL scheme (lower case) -> the factory that turns the whole spec, given the
#: credentials in force, into an origin.
SCHEMES: Mapping[str, Callable[[str, Credentials], Origin]] = {
    "http": _http_url,
    "https": _http_url,
    "file": _file_url,
}


def _open_one(spec: str, credentials: Credentials) -> Origin:
    text = spec.strip()
    if not text:
        raise ConfigError("empty origin; give a URL or a directory", variable="origin", value=spec)
    # The scheme as urlsplit reads it, whenever it is one of the table's ("https"
    # alone is a directory of that name).
    scheme, colon, _ = text.partition(":")
    factory = SCHEMES.get(scheme.lower()) if colon else None
    if factory is not None:
        # A port that is not a number in range, or a broken IPv6 literal, is refused
        # here, naming the spec: urlsplit would raise a bare ValueError later.
        split_url(text, variable="origin")
        return factory(text, credentials)
    if URL_SCHEME.match(text):
        # Only a spec that spells ``scheme://`` is a URL: "C:\\mirror" or "a:b" are paths,
        # and "alice:pw@host/c?next=https://..." is a server missing its scheme.
        scheme = text.split("://", 1)[0]
        known = ", ".join(f"{s}://" for s in sorted(SCHEMES))
        raise ConfigError(
            f"origin {redact_url(text)!r}: scheme {scheme}:// is not supported; "
            f"use one of {known}, or a directory path",
            variable="origin", value=scheme)
    if not os.path.isdir(text):
        # "127.0.0.1:8000" or "mirror.example/cubins" is a server missing its scheme far
        # more often than a mirror directory that does not exist yet.
        what = "a file" if os.path.exists(text) else "no such directory"
        path = text.startswith(("/", ".", "~")) or os.sep in text.split("/", 1)[0]
        # A server's "alice:pw@" and "?token=" are secrets; a path is shown as written.
        shown = text if path else redact_url(text)
        fix = ("give the path of an existing mirror directory" if path
               else f"write http://{shown} or https://{shown} for a server, or give the path "
                    "of an existing mirror directory")
        raise ConfigError(
            f"origin {shown!r} has no scheme and is not an existing directory ({what}); {fix}",
            variable="origin", value=shown)
    return DirOrigin(text)


def open_origin(
    spec: str | Origin | Sequence[str | Origin],
    *,
    credentials: Credentials | None = None,
) -> Origin:
    """An origin from a spec: a URL whose scheme is in :data:`SCHEMES` (``http(s)://``
    -> :class:`HttpOrigin`, ``file://`` naming an existing directory ->
    :class:`DirOrigin`), an existing directory -> :class:`DirOrigin`, an Origin as is;
    a comma-separated string or a sequence -> :class:`OriginChain` (a single entry is
    returned unwrapped).

    Each HTTP(S) origin gets the bearer token ``credentials`` binds to its scheme, host
    and port, and none when there is none; by default the settings' credentials
    (:meth:`Credentials.from_settings`: ``DISTCACHE_ORIGIN_TOKEN`` for the host of the
    first http(s) entry of ``DISTCACHE_ORIGIN`` only, and ``DISTCACHE_ORIGIN_TOKENS``).

    Raises:
        ConfigError: an empty spec, a ``scheme://`` not in :data:`SCHEMES` (the
            message names the spec and the known schemes), a URL whose port is not a
            number from 1 to 65535 or whose host is malformed, a spec without a scheme
            or a ``file://`` URL that is not an existing directory, or malformed
            credentials.
    """
    if credentials is None:
        credentials = Credentials.from_settings(settings())
    items: list[Origin] = []
    specs: Sequence[str | Origin] = [spec] if isinstance(spec, str) or not isinstance(
        spec, Sequence) else spec
    for item in specs:
        if isinstance(item, str):
            parts = [p for p in item.split(",") if p.strip()]
            if not parts:
                raise ConfigError("empty origin; give a URL or a directory",
                                  variable="origin", value=item)
            items.extend(_open_one(p, credentials) for p in parts)
        elif isinstance(item, Origin):
            items.append(item)
        else:
            raise ConfigError(f"not an origin: {item!r}", variable="origin", value=repr(item))
    if not items:
        raise ConfigError("no origin given; pass a URL or a directory, or set DISTCACHE_ORIGIN",
                          variable="origin", value="")
    return items[0] if len(items) == 1 else OriginChain(items)
