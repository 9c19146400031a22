"""HTTP(S) origin: stream, hash, retry, and never trust a redirect or a body.

A CDN under load (the cubin repository when a thousand ranks start at once) answers
429 and 5xx, drops connections mid-body and occasionally serves the wrong bytes.
:class:`HttpOrigin` retries those with jittered exponential backoff under a total cap,
honours ``Retry-After``, verifies every byte against the artifact's SHA-256 while
streaming, and follows redirects only to the same scheme and host (or hosts the
caller allowed), so a bearer token never leaves for another server.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import logging
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from email.utils import parsedate_to_datetime
from typing import BinaryIO
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

import requests
import urllib3.exceptions
from requests.adapters import HTTPAdapter

from distcache import __version__
from distcache.artifact import Artifact
from distcache.config import settings
from distcache.errors import ConfigError, IntegrityError, OriginError

__all__ = ["HttpOrigin", "redact_url"]

logger = logging.getLogger(__name__)

_CHUNK = 256 * 1024
# `timeout` bounds each socket read, so a server that drips a byte at a time could hold
# an attempt forever. An attempt may take `timeout` plus the body at this rate; past
# that it is abandoned and retried like a cut body.
_MIN_RATE_BPS = 64 * 1024
_REDIRECTS = {301, 302, 303, 307, 308}
_MAX_REDIRECTS = 5
# ASCII digits only: str.isdigit() also accepts "²" and other digits int() refuses.
_CONTENT_LENGTH = re.compile(r"[0-9]{1,20}\Z")
_SECRET_HEADERS = ("authorization", "cookie", "proxy-authorization")
# Statuses worth another try: the server is overloaded or a proxy timed out.
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}
_TRANSIENT = (
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


def redact_url(url: str) -> str:
    """``url`` without user-info and query (signed URLs carry secrets there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class _Retry(Exception):
    """One failed attempt that another attempt may fix."""

    def __init__(self, reason: str, *, status: int | None = None, delay: float | None = None,
                 integrity: tuple[str, str] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.delay = delay
        self.integrity = integrity  # (expected, actual) on a digest/size mismatch


class _Fatal(Exception):
    """A failed attempt that retrying cannot fix."""

    def __init__(self, reason: str, *, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


def rewind(out: BinaryIO, start: int | None) -> bool:
    """Drop what a failed attempt wrote into ``out`` after offset ``start``; False
    when ``out`` cannot be rewound (``start`` is None)."""
    if start is None:
        return False
    out.seek(start)
    out.truncate()
    return True


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        pass
    # An HTTP-date (RFC 9110 10.2.3).
    try:
        when = parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError, IndexError):
        return None


class HttpOrigin:
    """Artifacts at ``base_url + "/" + name`` over HTTP(S).

    ``timeout`` (seconds per connect/read) and ``retries`` (extra attempts per
    artifact) resolve as: argument > ``DISTCACHE_HTTP_TIMEOUT`` /
    ``DISTCACHE_HTTP_RETRIES`` > 30 s / 4. A bearer token is read from
    ``DISTCACHE_ORIGIN_TOKEN`` at construction and sent only to ``base_url``'s host;
    it never appears in :meth:`describe`, ``repr``, logs or errors.

    Redirects are followed (at most 5) only to the same scheme and host, or to a
    host in ``allow_redirect_hosts`` with the same scheme.

    Backoff between attempts is ``backoff_base * 2**n`` seconds with full jitter,
    each at most ``backoff_max``; ``Retry-After`` is honoured up to
    ``retry_after_max``; all waits for one artifact together stay under
    ``backoff_total``. ``sleep`` is the function that waits (tests pass a recorder).

    Raises:
        ConfigError: a scheme other than http/https, no host, or a bad timeout/retries.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = None,
        retries: int | None = None,
        headers: Mapping[str, str] | None = None,
        allow_redirect_hosts: Iterable[str] = (),
        pool_size: int = 16,
        backoff_base: float = 0.5,
        backoff_max: float = 10.0,
        retry_after_max: float = 30.0,
        backoff_total: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"origin URL {redact_url(base_url)!r} is not an http:// or https:// URL "
                "with a host; pass e.g. https://mirror.example/cubins, or a directory "
                "path for a local mirror",
                variable="base_url",
                value=redact_url(base_url),
            )
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}",
                              variable="timeout", value=timeout)
        if retries is not None and retries < 0:
            raise ConfigError(f"retries must be >= 0, got {retries}",
                              variable="retries", value=retries)
        resolved = settings(http_timeout=timeout, http_retries=retries)
        self.base_url = base_url.rstrip("/")
        self.timeout: float = resolved.http_timeout
        self.retries: int = resolved.http_retries
        self._scheme = parts.scheme
        self._origin_host = self._host_key(base_url)
        self._allowed_hosts = {h.lower() for h in allow_redirect_hosts}
        self._backoff = (backoff_base, backoff_max, retry_after_max, backoff_total)
        self._sleep = sleep
        self._rng = random.Random()
        self._headers = {
            "User-Agent": f"distcache/{__version__}",
            # Identity encoding makes Content-Length the body length we check.
            "Accept-Encoding": "identity",
        }
        self._headers.update(headers or {})
        self._token = self._clean_token(resolved.origin_token)
        # Values never to show in a message: requests quotes a header value it refuses
        # (a token read from a file with its newline) in the exception text.
        raw_secrets = [v for k, v in self._headers.items()
                       if k.lower() in _SECRET_HEADERS and isinstance(v, str)]
        if self._token:
            raw_secrets.append(self._token)
        # As given, trimmed, and as repr() escapes it (how requests quotes it).
        forms = {form for v in raw_secrets for form in (v, v.strip(), repr(v)[1:-1]) if form}
        self._secrets = tuple(sorted(forms, key=len, reverse=True))
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool_size, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    # -- Origin protocol ----------------------------------------------------------

    def describe(self) -> str:
        return redact_url(self.base_url)

    def __repr__(self) -> str:
        return f"HttpOrigin({self.describe()!r}, timeout={self.timeout}, retries={self.retries})"

    def url_for(self, artifact: Artifact) -> str:
        return f"{self.base_url}/{quote(artifact.name, safe='/')}"

    def fetch(self, artifact: Artifact) -> bytes:
        """The artifact's verified bytes.

        Raises:
            IntegrityError: every attempt delivered bytes with the wrong digest or size.
            OriginError: the origin cannot deliver it (``status`` is set when the
                server answered, 404 is never retried).
        """
        buffer = io.BytesIO()
        self.fetch_into(artifact, buffer)
        return buffer.getvalue()

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        """Stream the artifact into ``out`` while hashing it; return the byte count.

        A failed attempt's bytes are truncated away before the next one when ``out``
        is seekable; when it is not, the first failure after bytes were written ends
        the fetch (the caller discards ``out``).

        Raises:
            IntegrityError: every attempt delivered bytes with the wrong digest or size.
            OriginError: the origin cannot deliver it.
        """
        url = self.url_for(artifact)
        where = redact_url(url)
        start = out.tell() if out.seekable() else None
        attempts = self.retries + 1
        base, cap, retry_after_cap, total_cap = self._backoff
        waited = 0.0
        last: _Retry | None = None
        for attempt in range(1, attempts + 1):
            written = [0]
            try:
                return self._attempt(url, artifact, out, written)
            except _Fatal as exc:
                raise OriginError(
                    f"GET {where} failed: {exc.reason}; {self._advice(exc.status)}",
                    url=where, status=exc.status, name=artifact.name,
                ) from exc
            except _Retry as exc:
                last = exc
                if written[0] and not rewind(out, start):
                    break
            if attempt == attempts:
                break
            if last.delay is not None:
                delay = min(last.delay, retry_after_cap)
            else:
                delay = self._rng.uniform(0, min(cap, base * 2 ** (attempt - 1)))
            remaining = total_cap - waited
            if remaining <= 0 and waited > 0:
                break  # the waiting budget for this artifact is spent
            delay = max(0.0, min(delay, remaining))
            logger.warning("GET %s: %s; retry %d/%d in %.2fs", where, last.reason,
                           attempt, self.retries, delay)
            self._sleep(delay)
            waited += delay
        assert last is not None  # the loop ran at least once and did not return
        tried = f"{attempt} attempt{'s' if attempt > 1 else ''}"
        if last.integrity is not None:
            expected, actual = last.integrity
            raise IntegrityError(
                f"{last.reason} for {artifact.name} from {where} after {tried}: "
                f"expected {expected}, got {actual}; check the mirror or set DISTCACHE_ORIGIN",
                sha256=artifact.sha256, actual=actual, source=where,
            )
        raise OriginError(
            f"GET {where} failed after {tried}: {last.reason}; {self._advice(last.status)}",
            url=where, status=last.status, name=artifact.name,
        )

    def close(self) -> None:
        """Close pooled connections (idempotent)."""
        self._session.close()

    def __enter__(self) -> HttpOrigin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one attempt ---------------------------------------------------------------

    @staticmethod
    def _clean_token(token: str | None) -> str | None:
        if token is None:
            return None
        # Surrounding whitespace is what `export TOKEN=$(cat file)` and friends leave
        # behind; anything unprintable left inside would only fail later, in a header
        # error that quotes the value.
        token = token.strip()
        if not token:
            return None
        if not token.isprintable() or not token.isascii():
            raise ConfigError(
                "DISTCACHE_ORIGIN_TOKEN holds control or non-ASCII characters; "
                "set it to the bare token",
                variable="DISTCACHE_ORIGIN_TOKEN", value="<redacted>",
            )
        return token

    @staticmethod
    def _host_key(url: str) -> tuple[str, str, int | None]:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        return (parts.scheme, (parts.hostname or "").lower(), port)

    @staticmethod
    def _advice(status: int | None) -> str:
        if status == 404:
            return "the origin does not have it; check the name, the pin or DISTCACHE_ORIGIN"
        if status in (401, 403):
            return "the origin refused access; check DISTCACHE_ORIGIN_TOKEN"
        return "check the network and the origin, or set DISTCACHE_ORIGIN to a mirror"

    def _headers_for(self, url: str) -> dict[str, str]:
        if self._host_key(url) != self._origin_host:
            # Credentials are for the origin only, never for a host it redirects to.
            return {k: v for k, v in self._headers.items() if k.lower() not in _SECRET_HEADERS}
        headers = dict(self._headers)
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _get(self, url: str) -> requests.Response:
        current = url
        for _ in range(_MAX_REDIRECTS + 1):
            failure: _Retry | _Fatal | None = None
            cause: BaseException | None = None
            try:
                response = self._session.get(
                    current, headers=self._headers_for(current), stream=True,
                    timeout=self.timeout, allow_redirects=False,
                )
            except _TRANSIENT as exc:
                failure, cause = _Retry(f"{type(exc).__name__}: {self._scrub(exc)}"), exc
            except (requests.RequestException, urllib3.exceptions.HTTPError, ValueError) as exc:
                # ValueError: even with allow_redirects=False, requests parses a
                # redirect's Location (to offer the next request) and urlsplit raises
                # on a broken IPv6 literal or port.
                failure, cause = _Fatal(f"{type(exc).__name__}: {self._scrub(exc)}"), exc
            if failure is not None:
                if any(secret in str(cause) for secret in self._secrets):
                    # The foreign error quotes a credential: it must not travel along
                    # as the cause (tracebacks in logs print causes and contexts).
                    raise failure
                raise failure from cause
            if response.status_code not in _REDIRECTS:
                return response
            location = response.headers.get("Location")
            response.close()
            if not location:
                raise _Fatal(f"redirect {response.status_code} without a Location",
                             status=response.status_code)
            try:
                target = urljoin(current, location)
                scheme, host, _port = self._host_key(target)
            except ValueError:
                # A port out of range or a broken IPv6 literal: urlsplit raises.
                raise _Fatal(f"refused redirect to a malformed URL {location[:200]!r}",
                             status=response.status_code) from None
            if scheme != self._scheme:
                raise _Fatal(
                    f"refused redirect to another scheme ({redact_url(target)}); "
                    "only same-scheme redirects are followed", status=response.status_code)
            if (scheme, host, _port) != self._origin_host and host not in self._allowed_hosts:
                raise _Fatal(
                    f"refused redirect to another host ({redact_url(target)}); allow it "
                    "with allow_redirect_hosts", status=response.status_code)
            current = target
        raise _Fatal(f"more than {_MAX_REDIRECTS} redirects")

    def _scrub(self, exc: BaseException) -> str:
        # urllib3 messages name the pool and the URL path; keep the first line short.
        text = str(exc)
        for secret in self._secrets:
            text = text.replace(secret, "<redacted>")
        return text.splitlines()[0][:300] if text.strip() else ""

    def _attempt(self, url: str, artifact: Artifact, out: BinaryIO, written: list[int]) -> int:
        response = self._get(url)
        with response:
            status = response.status_code
            if status in _RETRY_STATUS or status >= 500:
                raise _Retry(f"HTTP {status}", status=status,
                             delay=_retry_after(response.headers.get("Retry-After")))
            if status != 200:
                raise _Fatal(f"HTTP {status}", status=status)
            length_header = (response.headers.get("Content-Length") or "").strip()
            expected_len = int(length_header) if _CONTENT_LENGTH.match(length_header) else None
            limit = artifact.size
            if limit is not None and expected_len is not None and expected_len != limit:
                # Refuse before reading: a body announced larger than the artifact is
                # not worth a byte of bandwidth or disk.
                raise _Retry("announced size mismatch",
                             integrity=(f"{limit} bytes", f"Content-Length {expected_len}"))
            digest = hashlib.sha256()
            budget = self.timeout + (limit or expected_len or _CHUNK) / _MIN_RATE_BPS
            try:
                for chunk in _body(response, budget):
                    if limit is not None and written[0] + len(chunk) > limit:
                        # Checked before writing: nothing past the declared size
                        # reaches ``out``.
                        raise _Retry("body longer than the artifact's size",
                                     integrity=(f"{limit} bytes", f"more than {limit}"))
                    if expected_len is not None and written[0] + len(chunk) > expected_len:
                        raise _Retry(f"body longer than its Content-Length {expected_len}")
                    digest.update(chunk)
                    out.write(chunk)
                    written[0] += len(chunk)
            except _Stalled:
                raise _Retry(f"body stalled: {written[0]} bytes in {budget:.1f} s "
                             f"(slower than {_MIN_RATE_BPS // 1024} KiB/s)") from None
            except _TRANSIENT as exc:
                raise _Retry(f"body cut short after {written[0]} bytes "
                             f"({type(exc).__name__})") from exc
        if expected_len is not None and written[0] != expected_len:
            raise _Retry(f"body cut short: {written[0]} of {expected_len} bytes")
        if limit is not None and written[0] != limit:
            raise _Retry("size mismatch", integrity=(f"{limit} bytes", f"{written[0]} bytes"))
        actual = digest.hexdigest()
        if actual != artifact.sha256:
            raise _Retry("sha256 mismatch", integrity=(artifact.sha256, actual))
        return written[0]


class _Stalled(Exception):
    """The body arrived slower than the attempt's budget allows."""


def _body(response: requests.Response, budget: float) -> Iterator[bytes]:
    """The decoded body in pieces as they arrive, until the attempt's ``budget``
    (seconds) runs out. ``read1`` returns whatever one socket read brings, so a server
    dripping bytes is noticed after its first piece past the budget, not after the
    whole body (iter_content blocks until a full chunk has arrived)."""
    raw = response.raw
    start = time.monotonic()
    while True:
        piece = raw.read1(_CHUNK, decode_content=True)
        if not piece:
            return
        yield piece
        if time.monotonic() - start > budget:
            raise _Stalled
