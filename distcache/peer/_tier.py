"""The peer tier as a loader sees it: one bounded, never-raising lookup.

A process reaches its node's agent over the agent's Unix socket. Which agent: the one
:func:`attach` named (``distcache.init`` does), else the socket ``DISTCACHE_PEERS``
names (``python -m launch --peers`` sets it for its program), whose request key is in
the file beside it (``<socket>.key``, readable by this user only). With neither, there
is no peer tier and :func:`lookup` answers ``None`` at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.config import settings
from distcache.errors import ArtifactNotFound

log = get_logger(__name__)

#: Seconds a lookup may spend in the peer tier before the loader goes on without it.
LOOKUP_BOUND_S = 30.0


class Tier(NamedTuple):
    """This node's agent as seen from one process."""

    endpoint: str  #: ``unix:PATH`` (or ``tcp://...``) of the node's agent
    key: bytes  #: signs every request to the agent; never shown
    bound: float = LOOKUP_BOUND_S

    def __repr__(self) -> str:
        return f"Tier(endpoint={self.endpoint!r}, bound={self.bound})"


class Lookup(NamedTuple):
    """A lookup's answer: the verified bytes and where they came from (``peer``:
    another node's agent; ``origin``: this node owns the artifact and its agent asked
    the origin; ``fallback``: no owner answered and this node's agent asked the
    origin; ``pool``: this node's pool held them after all)."""

    data: bytes
    source: str
    seconds: float


_lock = threading.Lock()
_attached: Tier | None = None
_from_env: dict[str, Tier | None] = {}
#: What lookups did in this process: outcome -> count.
counts: Counter[str] = Counter()


def attach(tier: Tier | None) -> None:
    """Make ``tier`` this process's peer tier (``None``: back to the environment's)."""
    global _attached
    with _lock:
        _attached = tier


def key_path(socket_path: str | Path) -> Path:
    return Path(f"{socket_path}.key")


def current() -> Tier | None:
    """The process's peer tier, if any (never raises)."""
    if _attached is not None:
        return _attached
    try:
        value = settings().peers
    except Exception:  # a bad setting is init's to report, not a lookup's
        return None
    if value in ("0", "1", ""):
        return None
    with _lock:
        if value not in _from_env:
            try:
                _from_env[value] = Tier(f"unix:{value}", key_path(value).read_bytes())
            except OSError as exc:
                log.warning("DISTCACHE_PEERS=%s: cannot read the agent's key: %s", value, exc)
                _from_env[value] = None
        return _from_env[value]


def _count(outcome: str) -> None:
    with _lock:
        counts[outcome] += 1


def lookup(artifact: Artifact, tier: Tier | None = None) -> Lookup | None:
    """The artifact from the node's agent, within ``tier.bound`` seconds; ``None`` when
    there is no tier or it did not serve (counted; the caller goes on as without it).

    Raises:
        ArtifactNotFound: the origin behind the owner has no such artifact (final
            where the origin is FlashInfer's own repository).
    """
    tier = tier if tier is not None else current()
    if tier is None:
        return None
    start = time.monotonic()
    try:
        from distcache.peer import _client  # http.client, with the first lookup

        got = _client.fetch(tier.endpoint, tier.key, artifact, fill=True, timeout=tier.bound,
                            deadline=tier.bound)
    except ArtifactNotFound:
        _count("not_at_origin")
        raise
    except Exception as exc:
        _count("failed")
        log.debug("peer tier did not serve %s: %s", artifact.name, exc)
        return None
    _count(got.source)
    return Lookup(got.data, got.source, time.monotonic() - start)
