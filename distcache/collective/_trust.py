"""Whether a sync's writers may send only what their logs gained since their cursors.

A writer's cursor (:mod:`distcache.collective._cursors`) says that what its pool's
journal and ``names.log`` held up to it reached every pool of the set the sync that
kept it was over. The set is named by pool ids, and a pool copied whole (baked into a
container image, restored from a backup, rsynced to another disk) keeps its id and its
cursors; a copy that synced with a pool elsewhere left that pool a cursor past objects
this copy never received, and no probe in a later job can tell (the original is not
there to be told apart from).

So each sync draws a token (rank 0 does), and every writer keeps it with its cursor
(a pool that keeps no files, in the caller's ``SyncState``): the pools of a set hold
one token only where the last sync over the set reached each of them, or copies of
them taken after it, which hold what it left. A writer reports its pool's token in the first bytes of what it sends, in the
exchange the sync makes anyway (:data:`SIZE` bytes a pool, alike where pools hold
alike). Where a writer sent from a cursor and the pools' tokens differ (a copy, a
restored backup, a pool whose cursor was not kept, cursors kept by a version without
tokens), the writers that sent from a cursor send their whole logs in one more
exchange, as a first sync over the set does; what they sent since their cursors
stays news. With nothing copied the tokens agree and there is no second exchange.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from distcache.collective._cursors import TOKEN_LENGTH

#: What a writer reports of its cursors: the token its pool holds for the set (None:
#: none), whether it sent anything from a cursor, and the token it drew for the next
#: sync (rank 0 only, None elsewhere: writers whose pools hold alike send alike, and
#: an exchange through node leaders keeps each distinct payload once). It opens the
#: writer's journal part (:func:`pack`); other ranks send none.
Trust = tuple[str | None, bool, str | None]

#: A token's raw bytes, and what :func:`pack` writes: a flags byte, then two tokens.
_BYTES = TOKEN_LENGTH // 2
SIZE = 1 + 2 * _BYTES
_HELD, _RESUMED, _DRAWN = 1, 2, 4


def draw() -> str:
    """A fresh token, for :data:`Trust`'s last part."""
    return secrets.token_hex(_BYTES)


def pack(trust: Trust) -> bytes:
    """``trust`` as :data:`SIZE` bytes (tokens are :func:`draw`'s, hex).

    Raises:
        ValueError: a token is not of :func:`draw`'s form.
    """
    held, resumed, drawn = trust
    flags = ((_HELD if held is not None else 0) | (_RESUMED if resumed else 0)
             | (_DRAWN if drawn is not None else 0))
    packed = (bytes([flags]) + bytes.fromhex(held or "00" * _BYTES)
              + bytes.fromhex(drawn or "00" * _BYTES))
    if len(packed) != SIZE:
        raise ValueError(f"a sync token is {_BYTES} bytes: {trust!r}")
    return packed


def unpack(blob: bytes) -> tuple[Trust, bytes]:
    """The :data:`Trust` that opens ``blob`` (a writer's journal part), and the rest.

    Raises:
        ValueError: ``blob`` is too short, or its flags are not :func:`pack`'s.
    """
    if len(blob) < SIZE or blob[0] & ~(_HELD | _RESUMED | _DRAWN):
        raise ValueError(f"sync report does not open with its cursors' token "
                         f"({len(blob)} bytes)")
    held = blob[1:1 + _BYTES].hex() if blob[0] & _HELD else None
    drawn = blob[1 + _BYTES:SIZE].hex() if blob[0] & _DRAWN else None
    return (held, bool(blob[0] & _RESUMED), drawn), blob[SIZE:]


def trusted(trusts: Sequence[Trust | None]) -> bool:
    """Whether what the writers sent is all a sync needs: none of them sent from a
    cursor, or every pool holds the same token."""
    held = [t for t in trusts if t is not None]
    if not any(resumed for _, resumed, _ in held):
        return True
    tokens = {token for token, _, _ in held}
    return len(tokens) == 1 and None not in tokens


def next_token(trusts: Sequence[Trust | None]) -> str | None:
    """The token every writer keeps when the sync succeeds: the one the lowest writer
    that drew one drew (rank 0; None: no writer did)."""
    return next((t[2] for t in trusts if t is not None and t[2] is not None), None)
