"""The peer tier as a loader sees it: one bounded, never-raising lookup.

A process reaches its node's agent over the agent's Unix socket. Which agent: the one
:func:`attach` named (``distcache.init`` does), else the socket ``DISTCACHE_PEERS``
names (``python -m launch --peers`` sets it for its program), whose request key is in
the file beside it (``<socket>.key``, readable by this user only). With neither, there
is no peer tier and :func:`lookup` answers ``None`` at once.

The key file is taken only when it is this user's own regular file, readable by
nobody else, of a key's length, and never through a symlink: in a pool directory
other users may write to (a group-shared one), anyone could otherwise rename a key and
socket of their own over the agent's and answer this process's lookups as its agent.
"""

from __future__ import annotations

import errno
import os
import stat
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
#: Seconds a lookup goes on past its bound, at most, while a download of the artifact
#: in the job goes on (its agent says so once per bound): the loader asking the origin
#: itself would download it once more. It only waits on that download, and stops
#: when it ends without the bytes.
FILLING_WAIT_S = 600.0

#: Bytes of a request key (``derive_key``'s HMAC-SHA256).
KEY_BYTES = 32
#: How the key file is opened: never through a symlink, never blocking on a FIFO.
_KEY_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


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


def read_key(path: Path) -> bytes:
    """The request key in ``path``, which must be this user's own regular file with no
    group or other permission bits and :data:`KEY_BYTES` long (opened without following
    a symlink, then checked on the open file, so it cannot be swapped in between).

    Raises:
        OSError: it cannot be read, or it is not such a file (the message says why).
    """
    try:
        fd = os.open(path, _KEY_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a symlink
            raise OSError(exc.errno, f"{path} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise OSError(f"{path} is owned by uid {st.st_uid}, not by this user "
                          f"(uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise OSError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others may "
                          "read or write it (an agent's key is 0600)")
        if st.st_size != KEY_BYTES:
            raise OSError(f"{path} holds {st.st_size} bytes, not a key's {KEY_BYTES}")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise OSError(f"{path}: read {len(key)} bytes, not a key's {KEY_BYTES}")
    return key


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
                _from_env[value] = Tier(f"unix:{value}", read_key(key_path(value)))
            except OSError as exc:
                log.warning("DISTCACHE_PEERS=%s: the agent's key is not used: %s; lookups "
                            "go to the origin, as without peers", value, exc)
                _from_env[value] = None
        return _from_env[value]


def _count(outcome: str) -> None:
    with _lock:
        counts[outcome] += 1


def lookup(artifact: Artifact, tier: Tier | None = None) -> Lookup | None:
    """The artifact from the node's agent, within ``tier.bound`` seconds, or while a
    download of it in the job goes on (up to :data:`FILLING_WAIT_S`: asked again, the
    agent only waits on that download and starts none); ``None`` when there is no tier
    or it did not serve (counted; the caller goes on as without it).

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

        join = False
        while True:
            asked = time.monotonic()
            try:
                # The agent is given the bound less a margin: it answers within the
                # bound, whatever its walk meets.
                got = _client.fetch(tier.endpoint, tier.key, artifact, fill=True,
                                    timeout=tier.bound,
                                    deadline=_client.budget_for(tier.bound), join=join)
                break
            except _client.Filling:
                if time.monotonic() - start >= max(tier.bound, FILLING_WAIT_S):
                    raise
                join = True  # wait on that download; never start another
                _count("waited")
                log.debug("peer tier: a download of %s goes on in the job; waiting on it",
                          artifact.name)
                _client.pause_after(asked)
    except ArtifactNotFound:
        _count("not_at_origin")
        raise
    except Exception as exc:
        _count("failed")
        log.debug("peer tier did not serve %s: %s", artifact.name, exc)
        return None
    _count(got.source)
    return Lookup(got.data, got.source, time.monotonic() - start)
