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
import re
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import unquote, urlsplit

from distcache._log import get_logger
from distcache._settings_lists import refuse_empty_entry
from distcache._urls import URL_SCHEME, redact_url
from distcache.config import settings
from distcache.errors import ConfigError
from distcache.origins._base import Origin, split_url
from distcache.origins._chain import OriginChain
from distcache.origins._credentials import Credentials
from distcache.origins._directory import DirOrigin

logger = get_logger(__name__)


def _file_url(spec: str, credentials: Credentials) -> Origin:
    parts = urlsplit(spec)
    if parts.netloc.lower() not in ("", "localhost") or not parts.path:
        # file://cubins/fmha names host "cubins": read as /fmha (or, without a path,
        # as the working directory) it would serve another directory's files.
        raise ConfigError(
            f"origin {redact_url(spec)!r} is not a local file URL; write file:///absolute/path "
            "(three slashes) or give the directory path itself",
            variable="origin", value=redact_url(spec))
    if "?" in spec or "#" in spec or not parts.path.startswith("/"):
        # A directory has no query or fragment: file:///data/cubins#v2 would be read as
        # /data/cubins, another release's files; file:cubins would move with the working
        # directory. No server reads this URL: it is shown as written.
        raise ConfigError(
            f"origin {spec!r} is not a file URL of a directory: a file URL names an "
            "absolute path, and '#' or '?' in it starts a fragment or a query; write "
            "file:///absolute/path, with '#' as %23 and '?' as %3F in a directory's name",
            variable="origin", value=spec)
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


#: A Windows drive path (``C:\\mirror``, ``D:/mirrors``); a backslash anywhere is one too.
_WINDOWS_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


def _refuse_unusable_path(text: str) -> None:
    """Refuse a spec that is not an existing directory because it is a path written
    for another shell or system, saying so (before it is taken for a server without
    its scheme, and shown as urlsplit reads it: ``c:\\mirror``, lower-cased).

    Raises:
        ConfigError: ``text`` starts with ``~`` (expanded by a shell only at the start
            of a word, never inside a comma-separated list), or is a Windows path.
    """
    if text.startswith("~"):
        example = f"$HOME{text[1:]}" if text == "~" or text.startswith("~/") else \
            "/home/alice/mirror for ~alice/mirror"
        raise ConfigError(
            f"origin {text!r} is not an existing directory: '~' is not expanded in an "
            "origin (a shell expands it only at the start of a word, not after a comma "
            f"or '='); write the full path, e.g. {example} (a shell expands $HOME anywhere)",
            variable="origin", value=text)
    if _WINDOWS_DRIVE.match(text) or "\\" in text:
        raise ConfigError(
            f"origin {text!r} is a Windows path, not a directory on this machine; give "
            "the mirror's path as this machine mounts it (/mnt/mirror, say), or its "
            "http(s):// URL",
            variable="origin", value=text)


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
        _refuse_unusable_path(text)
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


def _first_time(origin: Origin, text: str, seen: set[tuple[str, str]]) -> bool:
    """Whether ``origin`` (opened from ``text``) is not one already listed: a directory
    however it was written (``/m``, ``/m/``, ``file:///m``), a URL as written (two
    signed URLs differ in their query alone). A second entry would ask the same origin
    again for every artifact it lacks, and again wait out each retry of one that fails;
    it is dropped with a warning."""
    key = ("dir", str(origin.path)) if isinstance(origin, DirOrigin) else ("url", text)
    if key not in seen:
        seen.add(key)
        return True
    shown = key[1] if isinstance(origin, DirOrigin) else redact_url(text)
    logger.warning("origin %r is listed twice; it is asked once, in its first place", shown)
    return False


def open_origin(
    spec: str | Origin | Sequence[str | Origin],
    *,
    credentials: Credentials | None = None,
) -> Origin:
    """An origin from a spec: a URL whose scheme is in :data:`SCHEMES` (``http(s)://``
    -> :class:`HttpOrigin`, ``file://`` naming an existing directory ->
    :class:`DirOrigin`), an existing directory -> :class:`DirOrigin`, an Origin as is;
    a comma-separated string or a sequence -> :class:`OriginChain` (a single entry is
    returned unwrapped). An entry of a string listed twice (a directory however it is
    written) is kept in its first place only, with a warning.

    Each HTTP(S) origin gets the bearer token ``credentials`` binds to its scheme, host
    and port, and none when there is none; by default the settings' credentials
    (:meth:`Credentials.from_settings`: ``DISTCACHE_ORIGIN_TOKEN`` for the host of the
    first http(s) entry of ``DISTCACHE_ORIGIN`` only, and ``DISTCACHE_ORIGIN_TOKENS``).

    Raises:
        ConfigError: an empty spec or an empty entry in a comma-separated one
            (``a,,b``, a comma at an end), a ``scheme://`` not in :data:`SCHEMES` (the
            message names the spec and the known schemes), a URL whose port is not a
            number from 1 to 65535 or whose host is malformed, a spec without a scheme
            or a ``file://`` URL that is not an existing directory (a ``~`` path or a
            Windows path is said to be one), a ``file://`` URL with a relative path,
            a query or a fragment, or malformed credentials.
    """
    if credentials is None:
        credentials = Credentials.from_settings(settings())
    items: list[Origin] = []
    seen: set[tuple[str, str]] = set()
    specs: Sequence[str | Origin] = [spec] if isinstance(spec, str) or not isinstance(
        spec, Sequence) else spec
    for item in specs:
        if isinstance(item, str):
            parts = [p for p in item.split(",") if p.strip()]
            if not parts:
                raise ConfigError("empty origin; give a URL or a directory",
                                  variable="origin", value=item)
            refuse_empty_entry("origin", item)  # "$MIRROR,https://cdn" with MIRROR unset
            for part in parts:
                origin = _open_one(part, credentials)
                if _first_time(origin, part.strip(), seen):
                    items.append(origin)
        elif isinstance(item, Origin):
            items.append(item)
        else:
            raise ConfigError(f"not an origin: {item!r}", variable="origin", value=repr(item))
    if not items:
        raise ConfigError("no origin given; pass a URL or a directory, or set DISTCACHE_ORIGIN",
                          variable="origin", value="")
    return items[0] if len(items) == 1 else OriginChain(items)
