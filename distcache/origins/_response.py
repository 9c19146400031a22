"""One HTTP attempt's answer, and what to do about it.

:func:`read_response` turns a response into the artifact's bytes in ``out`` or into a
:class:`Retry` (another attempt may fix it: overload, a cut or stalled body, wrong
bytes from one cache node) or a :class:`Fatal` (it will not: 404, 403, a refused
redirect, a body over the byte cap, a certificate that fails verification, a proxy
refusing the tunnel). Bytes are hashed and counted as they stream, so nothing past
the artifact's declared size (or, for an artifact of unknown size, past the cap)
reaches ``out`` and a digest mismatch is known the moment the body ends.
:class:`Backoff` decides how long to wait before the next attempt; :func:`unreachable`
tells a refused connection or an unknown host from the rest, and
:func:`transport_failure` which other failures of the connection another attempt may
fix.
"""

from __future__ import annotations

import hashlib
import http.client
import http.cookiejar
import math
import random
import re
import socket
import ssl
import time
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from typing import Any, BinaryIO
from urllib.parse import urljoin, urlsplit, urlunsplit

import requests
import urllib3.exceptions
import urllib3.util

from distcache._record import Record
from distcache.artifact import Artifact
from distcache.origins._credentials import host_key
from distcache.origins._proxy import refused_tunnel, through_proxy
from distcache.origins._watchdog import (
    MIN_RATE_BPS,
    MIN_WINDOW,
    Stalled,
    Watchdog,
    WatchedAdapter,
    Window,
)

_CHUNK = 256 * 1024
# ASCII digits only: str.isdigit() also accepts "²" and other digits int() refuses.
_CONTENT_LENGTH = re.compile(r"[0-9]{1,20}\Z")
# Statuses worth another try: the server is overloaded or a proxy timed out.
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
# Server errors that say what the server cannot do at all: another attempt meets them.
_FINAL_STATUS = {501, 505}

#: Failures of the connection or the body that another attempt may not meet.
TRANSIENT = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.ContentDecodingError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    # The body is read with urllib3's read1 (see _body), so its own errors arrive
    # unwrapped by requests.
    urllib3.exceptions.DecodeError,
    urllib3.exceptions.SSLError,
    http.client.IncompleteRead,
)

#: Failures no other attempt would change. ValueError: even with
#: ``allow_redirects=False``, requests parses a redirect's Location (to offer the next
#: request) and urlsplit raises on a broken IPv6 literal or port.
FATAL = (requests.RequestException, urllib3.exceptions.HTTPError, ValueError)


class _Session(requests.Session):
    """A session that leaves redirects to its caller: even with
    ``allow_redirects=False`` requests reads a redirect's whole body (unbounded, at
    any pace) to prepare the next request, unless no redirect target is seen."""

    def get_redirect_target(self, resp: requests.Response) -> str | None:
        return None

    def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any,
                                   cert: Any) -> Any:
        # requests' merge, without reading the whole environment twice per request.
        from distcache.origins._environ import merge_environment

        return merge_environment(self, url, proxies, stream, verify, cert)


def new_session(pool_size: int) -> requests.Session:
    """A session keeping up to ``pool_size`` connections per host, never retrying
    on its own (the origin's attempts and backoff are its caller's), reading a
    redirect's body (the origin follows redirects itself) nor keeping cookies."""
    session = _Session()
    # No cookie is kept, so none is sent back: a cookie ignores ports, and one the
    # origin set (after the token was accepted, say) would otherwise go to another
    # port on its host that a redirect names, where no credential of the origin's goes.
    session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    adapter = WatchedAdapter(pool_connections=4, pool_maxsize=pool_size, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def watchdog(timeout: float, written: list[int]) -> Watchdog:
    """A deadline for one attempt (see :mod:`distcache.origins._watchdog`): when it is
    missed, the attempt's failure is a :class:`Retry` saying what the watchdog saw."""
    return Watchdog(timeout, written, Retry, (Retry, Fatal, *TRANSIENT))


def as_given(request: requests.PreparedRequest) -> requests.PreparedRequest:
    """An auth that sends the request's headers as they are: requests replaces an
    Authorization header with ~/.netrc's entry for the host unless an auth is given."""
    return request


class Retry(Exception):
    """One failed attempt that another attempt may fix."""

    def __init__(self, reason: str, *, status: int | None = None, delay: float | None = None,
                 integrity: tuple[str, str] | None = None,
                 body: tuple[str, int, str] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.delay = delay
        self.integrity = integrity  # (expected, actual) on a digest/size mismatch
        self.body = body  # the wrong body there: its sha256 (or ""), length, type


class Unreachable(Exception):
    """No connection to the host at all: a refused connect or a failed name lookup."""

    def __init__(self, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause
        self.reason = reason


class Fatal(Exception):
    """A failed attempt that retrying cannot fix."""

    def __init__(self, reason: str, *, status: int | None = None,
                 advice: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.advice = advice  # what to do, when the status alone does not say


def redirect_target(current: str, location: str) -> str:
    """``location`` resolved against ``current`` without its user-info, as requests
    sends it (prepared). ``current``'s user-info (an origin URL's ``alice:pw@``) is
    put back only on a target of its own scheme, host and port: it is a credential
    for that host alone.

    Raises:
        ValueError: a URL parsers read differently (``urljoin`` takes the host after
            the last ``@``, urllib3 ends it at a backslash): one with a backslash or
            an unprintable character, a ``location`` with user-info of its own, or
            one whose prepared form names another host for urlsplit (the credential
            check) than for urllib3 (the connection); or a URL that cannot be
            prepared.
    """
    base = urlsplit(current)
    info, at, netloc = base.netloc.rpartition("@")
    target = urljoin(urlunsplit(base._replace(netloc=netloc)), location)
    if ("\\" in target or not target.isprintable() or "@" in urlsplit(location).netloc
            or "@" in urlsplit(target).netloc):
        raise ValueError("a backslash, user-info or an unprintable character")
    prepared = requests.PreparedRequest()
    try:
        prepared.prepare_url(target, None)
    except requests.RequestException as exc:
        raise ValueError(f"cannot be prepared ({type(exc).__name__})") from None
    url = str(prepared.url)
    seen = host_key(url)
    parsed = urllib3.util.parse_url(url)
    if seen != (parsed.scheme, (parsed.host or "").lower().strip("[]"), parsed.port or seen[2]):
        raise ValueError("a host that parsers read differently")
    if at and seen == host_key(current):
        scheme, sep, rest = url.partition("://")
        return f"{scheme}{sep}{info}@{rest}"
    return url


def unreachable(exc: BaseException) -> str | None:
    """A short cause ("connection refused", "host name does not resolve (...)", each
    followed by " at the proxy <URL>" where the proxy is what it reached) when ``exc``
    (from requests) is a refused connection or a failed name lookup; ``None`` for
    every other failure (timeouts, resets, TLS errors and a resolver's temporary
    failure may pass)."""
    for error in _linked(exc):
        if isinstance(error, ConnectionRefusedError):
            return "connection refused" + through_proxy(exc)
        if isinstance(error, socket.gaierror) and error.errno != socket.EAI_AGAIN:
            # EAI_AGAIN is the resolver's "try again" (a DNS server under load as a
            # thousand ranks start): retried like any transient failure.
            return f"host name does not resolve ({error.strerror or error})" + through_proxy(exc)
    return None


def transport_failure(exc: BaseException, shown: str) -> Retry | Fatal:
    """What ``exc`` (from requests; its message as ``shown``) makes of the attempt: a
    :class:`Fatal` for a server certificate that fails verification (the same
    certificate fails every attempt, unlike a handshake cut short) or a proxy that
    refused the tunnel to the origin (it refuses every attempt; the origin gave no
    status), a :class:`Retry` for the rest."""
    text, linked = f"{type(exc).__name__}: {shown}", list(_linked(exc))
    tunnel = refused_tunnel(linked)
    if tunnel is not None:
        return Fatal(text, advice=f"the proxy refused the connection to the origin (HTTP "
                     f"{tunnel}); check HTTPS_PROXY, HTTP_PROXY and NO_PROXY, and the "
                     "proxy's credentials")
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in linked):
        return Fatal(text)
    return Retry(text)


def _linked(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it links to (causes, contexts, reasons, args)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        error = stack.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        linked = [error.__cause__, error.__context__, getattr(error, "reason", None),
                  *error.args]
        stack.extend(e for e in linked if isinstance(e, BaseException))


class Backoff(Record):
    """Waits between attempts: ``base * 2**n`` seconds with full jitter, each at most
    ``cap``; a server's ``Retry-After`` instead, up to ``retry_after_cap``; all waits
    for one artifact together at most ``total``."""

    _FIELDS = ("base", "cap", "retry_after_cap", "total")
    __slots__ = _FIELDS
    base: float
    cap: float
    retry_after_cap: float
    total: float

    def __init__(self, base: float, cap: float, retry_after_cap: float, total: float) -> None:
        self._assign(base, cap, retry_after_cap, total)

    def delay(self, attempt: int, hint: float | None, waited: float,
              rng: random.Random) -> float | None:
        """Seconds to wait after failed attempt ``attempt`` (1-based), given the
        server's ``hint`` and the seconds already ``waited``; None when the waiting
        budget is spent."""
        if hint is not None:
            delay = min(hint, self.retry_after_cap)
        else:
            delay = rng.uniform(0, min(self.cap, self.base * 2 ** (attempt - 1)))
        remaining = self.total - waited
        if remaining <= 0 and waited > 0:
            return None
        return max(0.0, min(delay, remaining))


def retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for; None when absent, unreadable, negative
    or not finite (the jittered backoff applies then, not the same wait on every rank)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    # An HTTP-date (RFC 9110 10.2.3).
    try:
        when = parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError, IndexError):
        return None


def read_response(response: requests.Response, artifact: Artifact, out: BinaryIO,
                  written: list[int], timeout: float, max_bytes: int,
                  elsewhere: str | None = None, watchdog: Watchdog | None = None) -> int:
    """Stream a (non-redirect) response's body into ``out``, verifying it against
    ``artifact``; return the byte count. ``written[0]`` counts what reached ``out``,
    also when this raises. ``timeout`` is the origin's per-read timeout and the length
    of the window the minimum rate is judged over; ``max_bytes`` caps a body of unknown
    size (nothing past it reaches ``out``). ``elsewhere`` is the (redacted) URL of the
    host a redirect led to when that is not the origin's: a refusal names it.
    ``watchdog`` (the attempt's) is told when the body starts and how long it may be.

    Raises:
        Retry: an overloaded server, a cut, stalled or overlong body, wrong bytes.
        Fatal: any other status than 200, or a body of unknown size over ``max_bytes``.
    """
    with response:
        status = response.status_code
        if not 200 <= status <= 599:
            what = ("a 1xx response in place of a final one" if 100 <= status < 200
                    else "a status HTTP does not define")
            raise Fatal(f"HTTP {status}, {what}" + f" (from {elsewhere})" * bool(elsewhere),
                        status=status, advice="check that the origin URL names an HTTP "
                        "server, or set DISTCACHE_ORIGIN to a mirror")
        if status in _RETRY_STATUS or (status >= 500 and status not in _FINAL_STATUS):
            raise Retry(f"HTTP {status}", status=status,
                        delay=retry_after(response.headers.get("Retry-After")))
        if status != 200 and elsewhere is not None:
            # That host was sent no credentials: its refusal says nothing of the token.
            raise Fatal(f"HTTP {status} from the redirect target {elsewhere}", status=status,
                        advice="check where the origin redirects to" if status in (401, 403)
                        else None)
        if status != 200:
            raise Fatal(f"HTTP {status}", status=status)
        # Taken as sent and judged by its digest: Apache labels a .tar.gz x-gzip
        # although its bytes are the artifact's. A failure names the coding.
        coding = (response.headers.get("Content-Encoding") or "identity").strip().lower()
        coded = "" if coding == "identity" else f" (sent with Content-Encoding: {coding[:40]})"
        kind = " ".join((response.headers.get("Content-Type") or "").split())[:60]
        # Transfer-Encoding overrides Content-Length (RFC 9112 6.3): a chunked body
        # ends at its last chunk, as urllib3 reads it, whatever length is announced.
        codings = (response.headers.get("Transfer-Encoding") or "").lower().split(",")
        chunked = "chunked" in (c.strip() for c in codings)
        length_header = "" if chunked else (response.headers.get("Content-Length") or "").strip()
        expected_len = int(length_header) if _CONTENT_LENGTH.match(length_header) else None
        limit = artifact.size
        if limit is not None and expected_len is not None and expected_len != limit:
            # Refuse before reading: a body announced larger than the artifact is
            # not worth a byte of bandwidth or disk.
            raise Retry(f"announced size mismatch{coded}",
                        integrity=(f"{limit} bytes", f"Content-Length {expected_len}"),
                        body=("", expected_len, kind))
        cap = max_bytes if limit is None else limit
        if limit is None and expected_len is not None and expected_len > cap:
            raise _over_cap(cap, f"announced Content-Length {expected_len}")
        if watchdog is not None:
            watchdog.reading(expected_len if expected_len is not None else cap)
        digest = hashlib.sha256()
        window = Window(max(timeout, MIN_WINDOW), time.monotonic())
        try:
            for chunk in _body(response, window, written):
                if written[0] + len(chunk) > cap:
                    # Checked before writing: nothing past the declared size or the
                    # cap reaches ``out``.
                    if limit is None:
                        raise _over_cap(cap, f"more than {cap} bytes")
                    raise Retry("body longer than the artifact's size",
                                integrity=(f"{limit} bytes", f"more than {limit}"))
                if expected_len is not None and written[0] + len(chunk) > expected_len:
                    raise Retry(f"body longer than its Content-Length {expected_len}")
                digest.update(chunk)
                out.write(chunk)
                written[0] += len(chunk)
        except Stalled as stalled:
            raise Retry(f"body stalled: {stalled.nbytes} bytes in the last "
                        f"{stalled.seconds:.1f} s, {written[0]} in all (slower than "
                        f"{MIN_RATE_BPS // 1024} KiB/s){coded}") from None
        except TRANSIENT as exc:
            raise Retry(f"body cut short after {written[0]} bytes "
                        f"({type(exc).__name__}){coded}") from exc
    if expected_len is not None and written[0] != expected_len:
        raise Retry(f"body cut short: {written[0]} of {expected_len} bytes")
    actual = digest.hexdigest()
    if limit is not None and written[0] != limit:
        raise Retry(f"size mismatch{coded}", integrity=(f"{limit} bytes", f"{written[0]} bytes"),
                    body=(actual, written[0], kind))
    if actual != artifact.sha256:
        raise Retry(f"sha256 mismatch{coded}", integrity=(artifact.sha256, actual),
                    body=(actual, written[0], kind))
    return written[0]


def _over_cap(cap: int, found: str) -> Fatal:
    return Fatal(f"body of an artifact of unknown size exceeds the cap of {cap} bytes "
                 f"({found})",
                 advice="give the artifact's size in the manifest, or raise "
                        "DISTCACHE_MAX_ARTIFACT_BYTES if it really is this large")


def _body(response: requests.Response, window: Window, written: list[int]) -> Iterator[bytes]:
    """The body in pieces as they arrive, judged by ``window`` after each one
    (``written[0]`` counts what was accepted). ``read1`` returns whatever one socket
    read brings, so a server dripping bytes is noticed after its first piece past a
    window, not after the whole body (iter_content blocks until a full chunk has
    arrived). The body is taken as sent, never decoded: identity is the only coding
    asked for, the digest is of the artifact's own bytes, and a decoder keeps reading
    for as long as a stream decodes to nothing."""
    raw = response.raw
    while True:
        piece = raw.read1(_CHUNK, decode_content=False)
        if not piece:
            return
        yield piece
        window.check(time.monotonic(), written[0])
