"""HTTP(S) origin: stream, hash, retry, and never trust a redirect or a body.

A CDN under load (the cubin repository when a thousand ranks start at once) answers 429 and 5xx,
drops connections mid-body and occasionally serves the wrong bytes. :class:`HttpOrigin` retries
those with jittered exponential backoff under a total cap, honours ``Retry-After``, verifies every
byte against the artifact's SHA-256 while streaming, and follows redirects itself (requests drops
``Authorization`` on a redirect to another host or port, but keeps it from http to https of one
host, and keeps every other header, ``X-Api-Key`` or ``Private-Token`` included, on any redirect):
only to the same scheme and host (or hosts the caller allowed), with the token and the caller's
headers only for the origin's own scheme, host and port. A refused connection or an unknown host
marks the origin down: the remaining artifacts fail at once with that cause instead of each being
retried.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import quote

from distcache._log import get_logger
from distcache._urls import redact_url
from distcache.artifact import Artifact
from distcache.config import Settings, check_seconds, setting
from distcache.errors import (
    ArtifactNotFound,
    ConfigError,
    IntegrityError,
    OriginError,
    OriginUnreachable,
)
from distcache.origins._base import BaseOrigin, rewind, split_url
from distcache.origins._catchall import SameAnswers
from distcache.origins._credentials import clean_token, host_key, host_name, redact

if TYPE_CHECKING:
    import random

    import requests

    from distcache.origins._response import Backoff

logger = get_logger(__name__)

_REDIRECTS = {301, 302, 303, 307, 308}
_MAX_REDIRECTS = 5

#: Seconds an unreachable origin is not asked again: a command's whole run, while a
#: process that serves for days (the FlashInfer wrapper) finds it again once it is back.
DOWN_SECONDS = 60.0

#: The ``defaults`` of HTTP origins made in this context: ``resolve_origin`` sets ``init``'s.
DEFAULTS: ContextVar[Settings | None] = ContextVar("http_origin_defaults", default=None)


def _user_agent() -> str:
    # distcache's own version module: the distribution's metadata scans all of sys.path.
    from distcache._version import __version__

    return f"distcache/{__version__}"


class HttpOrigin(BaseOrigin):
    """Artifacts at ``base_url + "/" + name`` over HTTP(S).

    ``timeout`` (seconds per connect/read), ``retries`` (extra attempts per artifact) and
    ``max_bytes`` (the body cap for an artifact of unknown size) resolve as: argument >
    ``DISTCACHE_HTTP_TIMEOUT`` / ``DISTCACHE_HTTP_RETRIES`` / ``DISTCACHE_MAX_ARTIFACT_BYTES``
    > 30 s / 4 / 4 GiB; only these rows are read, from ``defaults`` (:class:`Settings` or
    a mapping of variables), else :data:`DEFAULTS`, else ``os.environ``.

    ``token`` is a bearer token sent only to ``base_url``'s scheme, host and port (the
    origin reads no variable for it: :func:`open_origin` binds
    ``DISTCACHE_ORIGIN_TOKEN`` to one origin); it never appears in :meth:`describe`,
    ``repr``, logs or errors. So do ``headers``: any of them may be a credential.

    A refused connection or a host name that does not resolve is not retried: the
    origin is marked down for :data:`DOWN_SECONDS` (a command's whole run) and every
    fetch meanwhile raises :class:`~distcache.errors.OriginUnreachable` with the same
    cause at once, without a request. Nor is a wrong body that different artifacts
    came back as (one page for every path, :mod:`~distcache.origins._catchall`): an
    :class:`~distcache.errors.OriginError`. Redirects are followed (at most 5) only to
    the same scheme and host, or to a host in ``allow_redirect_hosts``, same scheme.

    Backoff between attempts is ``backoff_base * 2**n`` seconds with full jitter,
    each at most ``backoff_max``; ``Retry-After`` is honoured up to
    ``retry_after_max``; all waits for one artifact together stay under
    ``backoff_total``. ``sleep`` is the function that waits (tests pass a recorder).

    Raises:
        ConfigError: a scheme other than http/https, no host, a port that is not a
            number from 1 to 65535, a bad timeout, retries or max_bytes, or a token
            with control or non-ASCII characters.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = None,
        retries: int | None = None,
        headers: Mapping[str, str] | None = None,
        token: str | None = None,
        max_bytes: int | None = None,
        allow_redirect_hosts: Iterable[str] = (),
        pool_size: int = 16,
        backoff_base: float = 0.5,
        backoff_max: float = 10.0,
        retry_after_max: float = 30.0,
        backoff_total: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
        defaults: Settings | Mapping[str, str] | None = None,
    ) -> None:
        parts = split_url(base_url, variable="base_url")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"origin URL {redact_url(base_url)!r} is not an http:// or https:// URL "
                "with a host; pass e.g. https://mirror.example/cubins, or a directory "
                "path for a local mirror",
                variable="base_url",
                value=redact_url(base_url),
            )
        timeout = None if timeout is None else check_seconds(timeout, what="timeout", text=False)
        for name, value, least in (("retries", retries, 0), ("max_bytes", max_bytes, 1)):
            if value is not None and (type(value) is not int or value < least):
                raise ConfigError(f"{name} must be an integer >= {least}, got {value!r}",
                                  variable=name, value=value)
        self.base_url = base_url.rstrip("/")
        conf = DEFAULTS.get() if defaults is None else defaults
        self.timeout: float = setting("http_timeout", conf, timeout)
        self.retries: int = setting("http_retries", conf, retries)
        self.max_bytes: int = setting("max_artifact_bytes", conf, max_bytes)
        self._scheme = parts.scheme
        self._origin_host = host_key(base_url)
        # (cause, reason, since when) while unreachable; replaced whole, never mutated.
        self._down: tuple[str, str, float] | None = None
        self._allowed_hosts = {host_name(h) for h in allow_redirect_hosts}
        self._backoff_args = (backoff_base, backoff_max, retry_after_max, backoff_total)
        self._sleep = sleep
        self._rng: random.Random | None = None
        self._pid = -1  # the process the session was made in
        # Identity encoding makes Content-Length the body length we check; every host
        # gets these, the caller's headers go to the origin's own host only.
        self._own = {"Accept-Encoding": "identity"}
        self._given = dict(headers or {})
        self._token = clean_token(token, "token")
        # Values never to show in a message: requests quotes a header value it refuses
        # (a token read from a file with its newline) in the exception text. As given,
        # trimmed, and as repr() escapes it; under 4 characters a value is no secret,
        # and hiding it would garble the message ("1" in an address).
        raw = [v for v in (*self._given.values(), self._token) if isinstance(v, str)]
        forms = {f for v in raw for f in (v, v.strip(), repr(v)[1:-1]) if len(f) >= 4}
        self._secrets = tuple(sorted(forms, key=len, reverse=True))
        self._pool_size = pool_size
        # The HTTP stack (requests, urllib3) is set up with the first request: most
        # ranks never send one, and importing it costs more CPU than the rest of init.
        self._lock = threading.Lock()
        self._same = SameAnswers()
        self._session: Any = None
        self._backoff: Backoff | None = None

    def _ready(self) -> tuple[Any, Backoff]:
        """The session and the backoff, made on first use (thread-safe), and the
        session again in a child made by fork."""
        from distcache.origins._response import Backoff, new_session

        with self._lock:
            if self._pid != os.getpid():
                # The parent's pooled connections (a request of each on one socket reads
                # the other's answer) and jitter; closing copies tells the server nothing.
                if self._session is not None:
                    self._session.close()
                self._session, self._rng, self._pid = None, None, os.getpid()
            if self._session is None or self._backoff is None:
                self._backoff = Backoff(*self._backoff_args)
                # A caller's User-Agent comes later in a request's headers and wins.
                self._own = {"User-Agent": _user_agent(), **self._own}
                self._session = new_session(self._pool_size)
            return self._session, self._backoff

    def prepare(self) -> None:
        """Import the HTTP stack and build the session now (see :meth:`BaseOrigin.prepare`)."""
        self._ready()

    # -- Origin protocol ----------------------------------------------------------

    def describe(self) -> str:
        return redact_url(self.base_url)

    def __repr__(self) -> str:
        return f"HttpOrigin({self.describe()!r}, timeout={self.timeout}, retries={self.retries})"

    def url_for(self, artifact: Artifact) -> str:
        return f"{self.base_url}/{quote(artifact.name, safe='/')}"

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        """Stream the artifact into ``out`` while hashing it; return the byte count.

        A failed attempt's bytes are truncated before the next one where ``out`` is
        seekable; else a failure after bytes were written ends it (``out`` discarded).

        Raises:
            IntegrityError: every attempt delivered bytes with the wrong digest or size.
            ArtifactNotFound: the server answered 404 (never retried; ``status=404``).
            OriginUnreachable: the connection was refused or the host name does not
                resolve, now or less than :data:`DOWN_SECONDS` ago (never retried).
            OriginError: the origin cannot deliver it (``status`` is set when the
                server answered), or a body of unknown size exceeds ``max_bytes``.
        """
        from distcache.origins._response import Fatal, Retry, Unreachable

        url = self.url_for(artifact)
        where = redact_url(url)
        down = self._down
        if down is not None:
            if time.monotonic() - down[2] < DOWN_SECONDS:
                raise self._unreachable(down, artifact, where)
            self._down = None  # long enough: ask again
        _session, backoff = self._ready()
        start = out.tell() if out.seekable() else None
        attempts = self.retries + 1
        waited = 0.0
        last: Retry | None = None
        for attempt in range(1, attempts + 1):
            written = [0]
            try:
                return self._attempt(url, artifact, out, written)
            except Unreachable as exc:
                down = self._down
                if down is None:
                    down = self._down = (exc.cause, exc.reason, time.monotonic())
                    logger.debug("origin %s marked down for %.0f s: %s", self.describe(),
                                 DOWN_SECONDS, exc.reason)
                raise self._unreachable(down, artifact, where) from None
            except Fatal as exc:
                if written[0]:
                    rewind(out, start)  # a body over the cap: drop what came before it
                error = ArtifactNotFound if exc.status == 404 else OriginError  # 404: final
                advice = exc.advice or self._advice(exc.status)
                raise error(f"GET {where} failed: {exc.reason}; {advice}", url=where,
                            status=exc.status, name=artifact.name) from exc
            except Retry as exc:
                last = exc
                if exc.body is not None:  # one page for every path: fail now
                    self._same.check(exc.body, artifact, where)
                if written[0] and not rewind(out, start):
                    break
            if attempt == attempts:
                break
            if self._rng is None:  # at first use: every rank builds an origin, few retry
                import random
                self._rng = random.Random()
            delay = backoff.delay(attempt, last.delay, waited, self._rng)
            if delay is None:
                break  # the waiting budget for this artifact is spent
            logger.warning("GET %s: %s; retry %d/%d in %.2fs", where, last.reason,
                           attempt, self.retries, delay)
            self._sleep(delay)
            waited += delay
            out.write(b"")  # a stopped download (Stopper) asks nothing more: it raises here
        assert last is not None  # the loop ran at least once and did not return
        tried = f"{attempt} attempt{'s' if attempt > 1 else ''}"
        if last.integrity is not None:
            expected, actual = last.integrity
            raise IntegrityError(
                f"{last.reason} for {artifact.name} from {where} after {tried}: "
                f"expected {expected}, got {actual}; check the mirror or set DISTCACHE_ORIGIN",
                sha256=artifact.sha256, actual=actual, source=where, name=artifact.name,
            )
        raise OriginError(
            f"GET {where} failed after {tried}: {last.reason}; {self._advice(last.status)}",
            url=where, status=last.status, name=artifact.name,
        )

    def close(self) -> None:
        """Close pooled connections (idempotent)."""
        with self._lock:
            session = self._session
        if session is not None:
            session.close()

    def __enter__(self) -> HttpOrigin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one attempt ---------------------------------------------------------------

    def _unreachable(self, down: tuple[str, str, float], artifact: Artifact,
                     where: str) -> OriginUnreachable:
        cause, reason, _since = down
        return OriginUnreachable(
            f"origin {self.describe()} is unreachable: {reason}; it is not asked again for "
            f"{DOWN_SECONDS:.0f} s; check the URL and that the server is up, or set "
            "DISTCACHE_ORIGIN to a mirror",
            url=where, name=artifact.name, cause=cause)

    @staticmethod
    def _advice(status: int | None) -> str:
        if status == 404:
            return "the origin does not have it; check the name, the pin or DISTCACHE_ORIGIN"
        if status in (401, 403):
            return "the origin refused access; check DISTCACHE_ORIGIN_TOKEN"
        return "check the network and the origin, or set DISTCACHE_ORIGIN to a mirror"

    def _headers_for(self, url: str) -> dict[str, str]:
        if host_key(url) != self._origin_host:
            # The token and the caller's headers (any may be a credential) are for the
            # origin only, never for a host it redirects to.
            return dict(self._own)
        headers = {**self._own, **self._given}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _get(self, url: str) -> requests.Response:
        from distcache.origins._response import (
            FATAL,
            TRANSIENT,
            Fatal,
            Retry,
            Unreachable,
            as_given,
            redirect_target,
            transport_failure,
            unreachable,
        )

        session, _backoff = self._ready()
        current = url
        for _ in range(_MAX_REDIRECTS + 1):
            failure: Retry | Fatal | None = None
            cause: BaseException | None = None
            headers = self._headers_for(current)
            try:
                response = session.get(
                    current, headers=headers, stream=True, timeout=self.timeout,
                    allow_redirects=False,  # the bound token wins over ~/.netrc's:
                    auth=as_given if "authorization" in map(str.lower, headers) else None,
                )
            except TRANSIENT as exc:
                down = unreachable(exc)
                if down is not None and current != url:
                    # The host one artifact was sent to, not the origin: that artifact
                    # fails; the origin is not marked down for the others.
                    raise Fatal(f"{down} at the redirect target {redact_url(current)[:200]}"
                                ) from None
                if down is not None:
                    raise Unreachable(down, down) from None
                failure, cause = transport_failure(exc, self._scrub(exc)), exc
            except FATAL as exc:
                failure, cause = Fatal(f"{type(exc).__name__}: {self._scrub(exc)}"), exc
            if failure is not None:
                if redact(str(cause), self._secrets) != str(cause):
                    # The foreign error quotes a credential or a signed URL's query: it
                    # must not travel along as the cause (tracebacks print causes).
                    raise failure
                raise failure from cause
            if response.status_code not in _REDIRECTS:
                return response
            location = response.headers.get("Location")
            response.close()
            if not location:
                raise Fatal(f"redirect {response.status_code} without a Location",
                             status=response.status_code)
            try:  # resolved and checked as it will be sent (_response.redirect_target)
                target = redirect_target(current, location)
                scheme, host, _port = host_key(target)
            except ValueError as exc:
                raise Fatal(f"refused redirect to {redact_url(location)[:200]!r}: {exc}",
                            status=response.status_code) from None
            if scheme != self._scheme:
                raise Fatal(
                    f"refused redirect to another scheme ({redact_url(target)[:200]}); "
                    "only same-scheme redirects are followed", status=response.status_code)
            if (scheme, host, _port) != self._origin_host and host not in self._allowed_hosts:
                raise Fatal(
                    f"refused redirect to another host ({redact_url(target)[:200]}); allow it "
                    "with allow_redirect_hosts", status=response.status_code)
            current = target
        raise Fatal(f"more than {_MAX_REDIRECTS} redirects")

    def _scrub(self, exc: BaseException) -> str:
        # urllib3 messages name the pool and the URL path; keep the first line short.
        text = redact(str(exc), self._secrets)
        return text.splitlines()[0][:300] if text.strip() else ""

    def _attempt(self, url: str, artifact: Artifact, out: BinaryIO, written: list[int]) -> int:
        from distcache.origins._response import read_response, watchdog
        with watchdog(self.timeout, written) as watched:  # the attempt's own deadline
            response = self._get(url)
            elsewhere = host_key(response.url) != self._origin_host
            other = redact_url(response.url)[:200] if elsewhere else None
            return read_response(response, artifact, out, written, self.timeout,
                                 self.max_bytes, other, watched)
