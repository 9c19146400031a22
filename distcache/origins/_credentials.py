"""Which host a bearer token belongs to: :class:`Credentials`.

A token is bound to one host (scheme, host name, port), never to "every HTTP origin":
with ``DISTCACHE_ORIGIN=https://private-mirror,https://public-cdn`` the CDN must not
receive the mirror's token, nor must an integration's default origin (FlashInfer's
public repository) or a host a redirect points to. Two settings bind tokens:

- ``DISTCACHE_ORIGIN_TOKEN`` belongs to the first ``http(s)://`` entry of
  ``DISTCACHE_ORIGIN``; when ``DISTCACHE_ORIGIN`` has none, to the first of the origin
  list given explicitly (``--origin``, ``init(origin=...)``). Never to anything else.
- ``DISTCACHE_ORIGIN_TOKENS=host[:port]=token,...`` binds one token per host; a host
  without a port means the scheme's default port (443 for https, 80 for http). It
  wins over ``DISTCACHE_ORIGIN_TOKEN`` for the host they share.

``~/.netrc`` keeps working as requests reads it: per host, for a host no token here is
bound to.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from distcache._record import Record
from distcache.config import Settings
from distcache.errors import ConfigError

#: (scheme, lower-case host name, port); the port is the scheme's default when omitted.
HostKey = tuple[str, str, int | None]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_TOKENS_VARIABLE = "DISTCACHE_ORIGIN_TOKENS"
#: A URL's query as quoted in a foreign message: up to a space, a quote or a bracket.
_QUERY = re.compile(r"\?[^\s'\"()<>]+")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` (a foreign error message) with each of ``secrets`` and every URL query
    in it shown as ``<redacted>``: signed URLs carry their secret in the query
    (``?sig=``, ``?token=``)."""
    text = _QUERY.sub("?<redacted>", text)
    for secret in secrets:
        text = text.replace(secret, "<redacted>")
    return text


def host_key(url: str) -> HostKey:
    """``url``'s (scheme, host, port), the unit a credential is bound to; the host as
    :func:`host_name` writes it.

    Raises:
        ValueError: the port is not a number or is out of range, or a broken IPv6
            literal (from urlsplit).
    """
    parts = urlsplit(url)
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    return (parts.scheme, host_name(parts.hostname or ""), port)


def host_name(name: str) -> str:
    """``name`` in lower case, an internationalised one in its ASCII (IDNA) form as
    requests sends it: ``bücher.example`` and ``xn--bcher-kva.example`` are one host.
    A name IDNA cannot encode is kept as written (requests refuses to send to it)."""
    name = name.lower()
    if name.isascii():
        return name
    import idna  # requests' own dependency, loaded only for such a name

    try:
        return idna.encode(name, uts46=True).decode("ascii").lower()
    except UnicodeError:
        return name


def clean_token(token: str | None, variable: str) -> str | None:
    """``token`` without the surrounding whitespace ``$(cat file)`` leaves; ``None``
    when nothing is left.

    Raises:
        ConfigError: a control or non-ASCII character inside (the message never
            quotes the value).
    """
    if token is None:
        return None
    token = token.strip()
    if not token:
        return None
    if not token.isprintable() or not token.isascii():
        # Left in, it would fail later inside requests, whose error quotes the header.
        raise ConfigError(f"{variable} holds control or non-ASCII characters; set it to "
                          "the bare token", variable=variable, value="<redacted>")
    return token


def _http_entries(specs: Iterable[object]) -> list[str]:
    entries: list[str] = []
    for spec in specs:
        if isinstance(spec, str):
            entries.extend(p.strip() for p in spec.split(",")
                           if p.strip().lower().startswith(("http://", "https://")))
    return entries


class Credentials(Record):
    """Bearer tokens by :data:`HostKey`; :meth:`token_for` answers for one URL.

    The tokens never show in ``repr`` (only the hosts they are bound to do).
    """

    _FIELDS = ("tokens",)
    __slots__ = _FIELDS
    tokens: Mapping[HostKey, str]

    def __init__(self, tokens: Mapping[HostKey, str] | None = None) -> None:
        self._set("tokens", {} if tokens is None else tokens)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.tokens.items())))

    def token_for(self, url: str) -> str | None:
        """The token bound to ``url``'s scheme, host and port, or ``None``."""
        try:
            return self.tokens.get(host_key(url))
        except ValueError:
            return None

    def __repr__(self) -> str:
        hosts = sorted(f"{s}://{h}:{p}" for s, h, p in self.tokens)
        return f"Credentials(hosts={hosts})"

    @classmethod
    def none(cls) -> Credentials:
        """No token for any host."""
        return cls({})

    @classmethod
    def from_settings(cls, conf: Settings, explicit: Iterable[object] = ()) -> Credentials:
        """The tokens ``conf`` binds (see the module docstring): ``DISTCACHE_ORIGIN_TOKEN``
        to the first HTTP(S) entry of ``conf.origins``, else of ``explicit`` (the
        origin list given as an argument); then ``DISTCACHE_ORIGIN_TOKENS``.

        Raises:
            ConfigError: a malformed ``DISTCACHE_ORIGIN_TOKENS`` entry or an unusable
                token (never quoted).
        """
        tokens: dict[HostKey, str] = {}
        token = clean_token(conf.origin_token, "DISTCACHE_ORIGIN_TOKEN")
        if token is not None:
            first = _http_entries(conf.origins) or _http_entries(explicit)
            if first:
                # A malformed URL: open_origin refuses it itself, naming it.
                with contextlib.suppress(ValueError):
                    tokens[host_key(first[0])] = token
        tokens.update(parse_tokens(conf.origin_tokens))
        return cls(tokens)


def parse_tokens(text: str | None) -> dict[HostKey, str]:
    """``host[:port]=token,...`` (``DISTCACHE_ORIGIN_TOKENS``) -> tokens by host, each
    bound for both http and https on the port given, or on each scheme's default port.

    Raises:
        ConfigError: an entry without ``=``, without a host, or with a bad port or an
            unusable token; the message names the entry's position (and, for a bad
            port, its host and port), never a token.
    """
    tokens: dict[HostKey, str] = {}
    if text is None:
        return tokens
    for position, entry in enumerate((e for e in text.split(",") if e.strip()), 1):
        host, sep, raw = entry.partition("=")
        if sep:
            _check_port(host.strip(), position)
        host = host.strip().lower()
        token = clean_token(raw, _TOKENS_VARIABLE) if sep else None
        try:
            parts = urlsplit(f"//{host}")
            name, port = parts.hostname, parts.port
        except ValueError:
            name = port = None
        if not sep or token is None or not name or "/" in host or "@" in host:
            raise ConfigError(
                f"{_TOKENS_VARIABLE}: entry {position} is not host[:port]=token "
                "(e.g. mirror.example=TOKEN,cdn.example:8443=OTHER)",
                variable=_TOKENS_VARIABLE, value=f"entry {position}")
        for scheme, default in _DEFAULT_PORTS.items():
            tokens[(scheme, host_name(name), port or default)] = token
    return tokens


def _check_port(host: str, position: int) -> None:
    """Refuse the ``host[:port]`` of entry ``position`` when a port is written and it
    is not a number from 1 to 65535 (``host:0``, ``host:``, ``host:99999``,
    ``host:https``): read as the default port, or as no port, it would bind the token
    to another port than the one meant; and an IPv6 address without its brackets
    (``::1``), saying how to write it (not as a malformed entry).

    Raises:
        ConfigError: naming the entry's position, host and port; the token is shown
            as ``<redacted>``.
    """
    if ":" not in host.rpartition("]")[2]:  # no port; an IPv6 literal's colons are inside
        return
    name, _, port = host.rpartition(":")
    if ":" in name and not name.startswith("[") and _ipv6(host):
        raise ConfigError(
            f"{_TOKENS_VARIABLE}: entry {position} ({host}=<redacted>) looks like an IPv6 "
            f"address without brackets; write it as in the origin's URL, [{host}]=TOKEN "
            f"(or [{host}]:8443=TOKEN with a port)", variable=_TOKENS_VARIABLE,
            value=f"entry {position}: {host}=<redacted>")
    if port.isascii() and port.isdigit() and 0 < int(port) <= 65535:
        return
    raise ConfigError(
        f"{_TOKENS_VARIABLE}: entry {position} ({host}=<redacted>) has port {port!r}, "
        "not a number from 1 to 65535; write the port the origin's URL uses "
        f"({name}:8443=TOKEN), or leave it out ({name}=TOKEN) for the scheme's default "
        "port (443 for https, 80 for http)",
        variable=_TOKENS_VARIABLE, value=f"entry {position}: {host}=<redacted>")


def _ipv6(text: str) -> bool:
    """Whether ``text`` is an IPv6 address (a zone, ``%eth0``, aside)."""
    import ipaddress  # only for an entry that may be one

    try:
        ipaddress.IPv6Address(text.partition("%")[0])
    except ValueError:
        return False
    return True
