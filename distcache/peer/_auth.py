"""Request authentication between node agents: an HMAC of each request, never a secret.

The key is derived from the run scope's secret (:class:`distcache.comm.Adopted.scope`)
with HMAC-SHA256 under a fixed label, so the secret itself is used for nothing else
here. A request carries the time, a random nonce and
``HMAC(key, "v3\\nMETHOD\\nPATH\\nTIME\\nNONCE\\nDEADLINE\\nTARGET")`` in three headers
(the deadline, the seconds the asker gives the answer, in a fourth, signed too so that
it cannot be changed on the way; the target, the agent it is for, is not sent: each
side knows it, :func:`target_of`). The agent recomputes it for itself and compares in
constant time, refuses a time more than :data:`MAX_SKEW_S` away from its own clock,
and a nonce it has seen within that time (:class:`Nonces`): a request cannot be
replayed to it, nor sent to another node's agent, which computes another MAC. The
key never travels: a worker of the node reads it from a file only its user can read,
beside the agent's Unix socket.

Every answer to an authenticated request is signed by the agent too
(:func:`sign_answer`): an HMAC under the same key of the request's nonce and
signature, the status and the reason (for the object's bytes, where the agent got
them), in :data:`HEADER_ANSWER`. The asker takes an answer as final (the origin has no
such artifact) only when :func:`answer_signed`, and reads the bytes of one (which it
then checks against the sha256 it asked for) only after it: a process that answers at
an agent's endpoint without the key (one that took a stopped agent's port) is only
skipped, and cannot make an asker take in gigabytes first.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Mapping

#: The version of the request format; it is part of what is signed.
VERSION = "v3"
#: Seconds a request's time may differ from the agent's clock.
MAX_SKEW_S = 300.0
HEADER_TIME = "X-Distcache-Time"
HEADER_NONCE = "X-Distcache-Nonce"
HEADER_AUTH = "X-Distcache-Auth"
#: Seconds the asker gives the answer (its budget); signed with the request.
HEADER_DEADLINE = "X-Distcache-Deadline"
#: The agent's signature of its answer.
HEADER_ANSWER = "X-Distcache-Answer-Auth"
_LABEL = b"distcache peer agent v1"


def derive_key(secret: bytes) -> bytes:
    """The agents' request key for a run whose scope secret is ``secret``."""
    if len(secret) < 16:
        raise ValueError("a peer key needs a secret of at least 16 bytes")
    return hmac.new(secret, _LABEL, hashlib.sha256).digest()


def target_of(endpoint: str) -> str:
    """What a request to the agent at ``endpoint`` is signed for: its TCP endpoint
    (``tcp://HOST:PORT``, the string the job's agents shared), or ``unix`` for a node's
    own agent over its Unix socket, which only this user can reach (its path may be
    spelled differently by the processes of the node)."""
    return "unix" if endpoint.startswith("unix:") else endpoint


def _mac(key: bytes, method: str, path: str, when: str, nonce: str, deadline: str,
         target: str) -> str:
    text = "\n".join((VERSION, method, path, when, nonce, deadline, target)).encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, *, target: str, deadline: str = "",
         now: float | None = None) -> dict[str, str]:
    """The headers that authenticate one request of ``method`` for ``path`` to the
    agent ``target`` (:func:`target_of` its endpoint), with ``deadline``, the signed
    deadline header too."""
    when = f"{time.time() if now is None else now:.3f}"
    nonce = os.urandom(12).hex()
    headers = {HEADER_TIME: when, HEADER_NONCE: nonce,
               HEADER_AUTH: _mac(key, method, path, when, nonce, deadline, target)}
    if deadline:
        headers[HEADER_DEADLINE] = deadline
    return headers


def verify(key: bytes, method: str, path: str, headers: Mapping[str, str], *, target: str,
           now: float | None = None) -> str | None:
    """``None`` when ``headers`` authenticate the request to the agent ``target`` (as
    :func:`sign`), else why not (for the log; the asker only learns that it was
    refused)."""
    when, nonce, mac = (headers.get(h) for h in (HEADER_TIME, HEADER_NONCE, HEADER_AUTH))
    if not when or not nonce or not mac:
        return "no authentication headers"
    try:
        skew = abs((time.time() if now is None else now) - float(when))
    except ValueError:
        return "a malformed time"
    if not skew <= MAX_SKEW_S:
        return f"a time {skew:.0f} s off"
    expected = _mac(key, method, path, when, nonce, headers.get(HEADER_DEADLINE) or "",
                    target).encode()
    if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected):
        return "a wrong signature"
    return None


def _answer_mac(key: bytes, request: Mapping[str, str], status: int, reason: str) -> str:
    text = "\n".join((f"{VERSION}-answer", request.get(HEADER_NONCE) or "",
                      request.get(HEADER_AUTH) or "", str(status), reason)).encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def sign_answer(key: bytes, request: Mapping[str, str], status: int, reason: str) -> str:
    """The :data:`HEADER_ANSWER` value of the answer ``status`` with ``reason`` to the
    authenticated request whose headers are ``request`` (its nonce and signature)."""
    return _answer_mac(key, request, status, reason)


def answer_signed(key: bytes, request: Mapping[str, str], status: int, reason: str,
                  mac: str | None) -> bool:
    """Whether ``mac`` (the answer's :data:`HEADER_ANSWER`) is the agent's signature of
    the answer ``status`` with ``reason`` to the request sent with headers ``request``."""
    if not mac or not request.get(HEADER_NONCE) or not request.get(HEADER_AUTH):
        return False
    expected = _answer_mac(key, request, status, reason).encode()
    return hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected)


class Nonces:
    """The nonces of the requests an agent accepted within :data:`MAX_SKEW_S` (and as
    long again: a time may be that far either side of its clock), so that none is
    accepted twice. Thread-safe."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pruned = time.monotonic()

    def first(self, nonce: str) -> bool:
        """Whether ``nonce`` is new (it is remembered from now on)."""
        now = time.monotonic()
        with self._lock:
            if now - self._pruned > MAX_SKEW_S / 10:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                self._pruned = now
            if nonce in self._seen:
                return False
            self._seen[nonce] = now + 2 * MAX_SKEW_S
            return True
