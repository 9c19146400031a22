"""The peer tier: a lazy miss served once per job across nodes.

One agent per node (:class:`Agent`, hosted by the node's first rank under
``distcache.init`` or by ``python -m launch --peers``) serves the node's pool over
HTTP to the other agents and, over a Unix socket, to the node's processes. The owner
of an artifact is chosen by rendezvous hashing over the agents' endpoints
(:func:`owner`); a miss asks the owner, which answers from its pool or is the one
node of the job that asks the origin (concurrent askers wait on that one download).
Requests are authenticated with an HMAC keyed from the run scope's secret. See
docs/peers.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distcache.peer._auth import derive_key, sign, target_of, verify
from distcache.peer._flight import Singleflight
from distcache.peer._hosting import (
    Hosted,
    Starting,
    host_agent,
    job_address,
    origin_or_default,
    start,
    start_for_session,
)
from distcache.peer._ring import order, owner
from distcache.peer._tier import LOOKUP_BOUND_S, Lookup, Tier, attach, counts, current, lookup

if TYPE_CHECKING:
    from distcache.peer._agent import Agent
    from distcache.peer._client import Answer, fetch

__all__ = [
    "LOOKUP_BOUND_S",
    "Agent",
    "Answer",
    "Hosted",
    "Lookup",
    "Singleflight",
    "Starting",
    "Tier",
    "attach",
    "counts",
    "current",
    "derive_key",
    "fetch",
    "host_agent",
    "job_address",
    "lookup",
    "order",
    "origin_or_default",
    "owner",
    "sign",
    "start",
    "start_for_session",
    "target_of",
    "verify",
]


def __getattr__(name: str) -> Any:
    # The agent (and http.server with it) is loaded by the node leaders that host one,
    # not by every process that imports the package.
    if name == "Agent":
        from distcache.peer._agent import Agent

        return Agent
    if name in ("Answer", "fetch"):
        from distcache.peer import _client

        return getattr(_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
