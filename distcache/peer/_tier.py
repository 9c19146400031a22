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
from distcache.peer._backoff import Backoff

log = get_logger(__name__)

#: Seconds a lookup may spend in the peer tier before the loader goes on without it.
LOOKUP_BOUND_S = 30.0
#: Seconds a lookup goes on past its bound, at most, while a download of the artifact
#: in the job goes on (its agent says so once per bound): the loader asking the origin
#: itself would download it once more. It only waits on that download, and stops
#: when it ends without the bytes.
FILLING_WAIT_S = 600.0
#: Seconds lookups leave out a node agent that said nothing within a lookup's whole
#: bound (a stopped or wedged process: the kernel still accepts for it), could not be
#: reached, or answered as no agent of the job does; doubled each time it is asked
#: again and fails again, up to :data:`LEFT_OUT_MAX_S`. Its first answer ends it.
LEFT_OUT_S = 10.0
LEFT_OUT_MAX_S = 300.0

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
#: The node agents this process's lookups leave out, and those said so at WARNING.
_down = Backoff()
_told: set[str] = set()


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
    if _down.skip(tier.endpoint, tier.bound):  # it said nothing lately: the origin
        _count("left_out")
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
        _answered(tier)
        raise
    except Exception as exc:
        _count("failed")
        _failed(tier, artifact, exc)
        return None
    _count(got.source)
    _answered(tier)
    return Lookup(got.data, got.source, time.monotonic() - start)


def _answered(tier: Tier) -> None:
    if _down.answered(tier.endpoint):
        log.info("peer tier: the node agent at %s answers again; lookups ask it again",
                 tier.endpoint)


def _failed(tier: Tier, artifact: Artifact, exc: Exception) -> None:
    """Leave the node agent out for a while where ``exc`` says it is stopped, wedged,
    gone or not this job's (every ask was given the whole bound); the first time,
    at WARNING."""
    from distcache.peer import _client

    status = getattr(exc, "status", 0)
    if not (status is None or _client.gone(exc, whole=True)):
        if status != 0:  # a refusal or a busy answer: it answers
            _answered(tier)
        else:  # no verdict: the other lookups may ask it again now
            _down.release(tier.endpoint)
        log.debug("peer tier did not serve %s: %s", artifact.name, exc)
        return
    seconds = _down.failed(tier.endpoint, LEFT_OUT_S, LEFT_OUT_MAX_S)
    what = ("could not be reached" if status is None and not isinstance(exc, _client.Wrong)
            else f"said nothing within a lookup's whole bound of {tier.bound:.0f} s"
            if isinstance(exc, _client.Silent) else "answered as no agent of this job does")
    with _lock:
        first = tier.endpoint not in _told
        _told.add(tier.endpoint)
    (log.warning if first else log.debug)(
        "peer tier: the node agent at %s %s (%s); lookups leave it out for %.0f s and go "
        "to the origin, longer while it stays so (up to %.0f s), then ask it again. A "
        "stopped (SIGSTOP, a debugger) or wedged process is the usual cause: check the "
        "process that hosts it (the node's first rank, or python -m launch --peers)%s",
        tier.endpoint, what, exc, seconds, LEFT_OUT_MAX_S,
        "" if first else "; said once at WARNING")
