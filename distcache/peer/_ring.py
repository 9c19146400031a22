"""Which node owns an artifact: rendezvous (highest random weight) hashing.

Every node leader's endpoint gets a weight per artifact, the first 8 bytes of
``sha256(artifact sha256 + "\\0" + endpoint)``; the order of the weights, highest
first, is the order in which nodes are asked. All ranks compute the same order from
the endpoints exchanged once at start-up, with no collective at serving time, and a
node that leaves moves only the artifacts it owned, each to the next in its order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def weight(sha256: str, endpoint: str) -> int:
    digest = hashlib.sha256(f"{sha256}\0{endpoint}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def order(sha256: str, endpoints: Sequence[str]) -> list[int]:
    """Indexes into ``endpoints``, the owner of ``sha256`` first (ties: lower index)."""
    return sorted(range(len(endpoints)), key=lambda i: (-weight(sha256, endpoints[i]), i))


def owner(sha256: str, endpoints: Sequence[str]) -> int:
    """The index of the endpoint that owns ``sha256``."""
    if not endpoints:
        raise ValueError("no endpoints to choose an owner from")
    return order(sha256, endpoints)[0]
