"""Request authentication between node agents: an HMAC of each request, never a secret.

The key is derived from the run scope's secret (:class:`distcache.comm.Adopted.scope`)
with HMAC-SHA256 under a fixed label, so the secret itself is used for nothing else
here. A request carries the time, a random nonce and
``HMAC(key, "v1\\nMETHOD\\nPATH\\nTIME\\nNONCE")`` in three headers; the agent
recomputes it and compares in constant time, and refuses a time more than
:data:`MAX_SKEW_S` away from its own clock. The key never travels: a worker of the
node reads it from a file only its user can read, beside the agent's Unix socket.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Mapping

#: The version of the request format; it is part of what is signed.
VERSION = "v1"
#: Seconds a request's time may differ from the agent's clock.
MAX_SKEW_S = 300.0
HEADER_TIME = "X-Distcache-Time"
HEADER_NONCE = "X-Distcache-Nonce"
HEADER_AUTH = "X-Distcache-Auth"
_LABEL = b"distcache peer agent v1"


def derive_key(secret: bytes) -> bytes:
    """The agents' request key for a run whose scope secret is ``secret``."""
    if len(secret) < 16:
        raise ValueError("a peer key needs a secret of at least 16 bytes")
    return hmac.new(secret, _LABEL, hashlib.sha256).digest()


def _mac(key: bytes, method: str, path: str, when: str, nonce: str) -> str:
    text = "\n".join((VERSION, method, path, when, nonce)).encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, *, now: float | None = None) -> dict[str, str]:
    """The headers that authenticate one request of ``method`` for ``path``."""
    when = f"{time.time() if now is None else now:.3f}"
    nonce = os.urandom(12).hex()
    return {HEADER_TIME: when, HEADER_NONCE: nonce,
            HEADER_AUTH: _mac(key, method, path, when, nonce)}


def verify(key: bytes, method: str, path: str, headers: Mapping[str, str], *,
           now: float | None = None) -> str | None:
    """``None`` when ``headers`` authenticate the request, else why not (for the log;
    the asker only learns that it was refused)."""
    when, nonce, mac = (headers.get(h) for h in (HEADER_TIME, HEADER_NONCE, HEADER_AUTH))
    if not when or not nonce or not mac:
        return "no authentication headers"
    try:
        skew = abs((time.time() if now is None else now) - float(when))
    except ValueError:
        return "a malformed time"
    if not skew <= MAX_SKEW_S:
        return f"a time {skew:.0f} s off"
    expected = _mac(key, method, path, when, nonce).encode()
    if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected):
        return "a wrong signature"
    return None
