"""How a URL is shown in a message, a log line or a repr: :func:`redact_url`. In the
base layer, beside the settings whose repr uses it and below the origins that quote
URLs in their errors."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

#: A URL's ``scheme://`` as RFC 3986 spells the scheme.
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def redact_url(url: str) -> str:
    """``url`` without user-info and query (signed URLs carry secrets there), for a
    message. A port that is not a number in range is shown as ``...``: a password
    written without its ``@host`` is read as the port, and a 5-digit PIN is a number
    out of range like a mistyped port. A URL whose host urlsplit cannot read (a broken
    IPv6 literal) is cut to its scheme. A server written without its scheme
    (``alice:pw@mirror/c``) loses its user-info too.

    A password holding ``/`` (base64 tokens do) ends the authority early for urlsplit:
    where the port is no port, an ``@`` further on ends the user-info and everything up
    to it is shown as ``...@``. Where the user-info has a password and an ``@`` comes
    further on, the password may run on to it or the path may hold it, which cannot
    be told apart: only the scheme is shown (never a host that may be a part of the
    password, or of a query). An ``@`` in the path of a URL without a password
    (``https://host/pkg@1.0/f``) is left alone.

    A password holding ``#`` or ``?`` ends the authority early too: where the port is
    no port (``alice:Hunter2#x@host/c``), everything up to the last ``@`` is user-info
    and shown as ``...@``. Where the port is a number or absent
    (``https://alice:4711#x@host/``), the authority may be user-info or the host
    followed by a query or fragment holding an ``@``, which cannot be told apart:
    only the scheme is shown."""
    if not URL_SCHEME.match(url) and not url.startswith("/") and "@" in url:
        # urlsplit would read "alice" as the scheme and keep the password in the path.
        return redact_url("//" + url).removeprefix("//")
    try:
        parts = urlsplit(url)
    except ValueError:
        # Only a scheme as RFC 3986 spells it: what precedes a "://" in a password is
        # no scheme.
        scheme = URL_SCHEME.match(url)
        return f"{scheme.group()}..." if scheme else "..."
    try:
        port: int | str | None = parts.port
        broken = False
    except ValueError:
        port, broken = "...", True
    _info, at, rest = f"{parts.path}?{parts.query}#{parts.fragment}".rpartition("@")
    # What follows the authority as written; not found (urlsplit dropped a tab or a
    # newline from it), it counts as an authority ended early.
    begin = url.find("//" + parts.netloc) if parts.netloc else -1
    after = url[begin + 2 + len(parts.netloc):][:1] if begin >= 0 else "?" * bool(parts.netloc)
    if at and broken:
        shown = redact_url(f"{parts.scheme}:" * bool(parts.scheme) + "//" + rest)
        return shown.replace("//", "//...@", 1)
    if at and (after in ("?", "#") or ":" in parts.netloc.rpartition("@")[0]):
        return f"{parts.scheme}://..." if parts.scheme else "..."
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address, written back in its brackets
        host = f"[{host}]"
    if port is not None:
        host = f"{host}:{port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
