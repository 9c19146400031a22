"""Asking a node agent for an object: ``http.client`` over TCP or a Unix socket.

An endpoint is ``tcp://HOST:PORT`` (another node's agent) or ``unix:PATH`` (this
node's). Every request is signed (:mod:`distcache.peer._auth`); every answer's bytes
are checked against the sha256 asked for before they are returned, so a peer can make
a lookup fail but never hand over other bytes; and an answer taken as final (the origin
behind the agent has no such artifact) must carry the agent's signature of it, under the
same key, for this very request: one without is a hop that did not answer
(:class:`Unsigned`), never the end of a lookup. An answer with a body (the bytes; an
agent's refusals have none) must carry it too before the body is read: one that does
not costs the asker no memory. A Unix socket is dialled only when this
user listens on it (the kernel says who): another's is a hop to an agent not there.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import os
import socket
import struct
import threading
import time
from urllib.parse import quote

from distcache._record import Record
from distcache.artifact import Artifact, sha256_hex
from distcache.config import setting
from distcache.errors import ArtifactNotFound, PeerError
from distcache.peer._auth import HEADER_ANSWER, answer_signed, sign, target_of

#: Seconds to open a connection to an agent: a live agent accepts at once, so an
#: owner that does not is skipped for the next in rendezvous order.
CONNECT_TIMEOUT_S = 1.0
HEADER_SOURCE = "X-Distcache-Source"
HEADER_REASON = "X-Distcache-Reason"
#: The answer's reason when the origin behind the agent has no such artifact.
NOT_AT_ORIGIN = "not-at-origin"
#: The answer's reason when the agent's download of the artifact goes on past the
#: asker's budget: asked again, it serves the same download's bytes.
FILLING = "filling"
#: Seconds between two asks of an agent that said a download goes on, at least (an
#: answer that comes sooner is not asked again at once).
REASK_S = 0.1
#: What caps an answer for an artifact of unknown size (one of known size: its size):
#: bytes read as they come, never allocated ahead of them, and never copied whole.
MAX_ANSWER_VARIABLE = "DISTCACHE_MAX_ARTIFACT_BYTES"
#: Bytes read from an answer at a time.
_READ_BYTES = 1 << 20
#: Seconds of a hop an asker keeps for the answer to come back: the agent is given the
#: hop less this (less a quarter of a hop shorter than 4 s) as its budget, so that one
#: waiting on another asker's fill says so (503) within the hop, and one that says
#: nothing in a whole hop is taken for a stopped or wedged one.
ANSWER_MARGIN_S = 1.0


class Answer(Record):
    """Verified bytes and where the agent got them: ``pool`` (its pool held them),
    ``peer`` (another node's agent), ``origin`` (it owns the artifact and asked the
    origin), ``fallback`` (it asked the origin because no owner answered)."""

    _FIELDS = ("data", "source")
    __slots__ = _FIELDS
    data: bytes
    source: str

    def __init__(self, data: bytes, source: str) -> None:
        self._assign(data, source)


class Unanswered(PeerError):
    """Connected, but the agent's answer broke off: the connection closed or reset
    after its head came, or it carried what no agent sends. ``status`` 0, as every answer that
    did not come whole; an owner walk leaves such an agent out for a while."""


class Unsigned(Unanswered):
    """An answer other than a bare 403 came without the agent's signature of it (a
    final one, a redirect, a status no agent sends): not from an agent of this job
    (another process on its port, another run secret). The walk leaves it out for a
    while and asks the next node, as for a broken answer."""


class Filling(PeerError):
    """The agent's download of the artifact goes on past this request's budget, as it
    signed: asking it again joins that download, where asking the next node would ask
    the origin a second time. ``status`` 503."""


class Silent(Unanswered):
    """Connected, but no status line and headers came within the whole time given:
    a stopped or wedged agent (the kernel still accepts for it), not a busy one."""


class Wrong(PeerError):
    """An answer no agent of ours sends: bytes that are not the artifact's, or more
    of them than it may have (``status`` 200, or None for too many). An owner walk
    leaves such a peer out for a while and names it."""


def gone(exc: BaseException, *, whole: bool) -> bool:
    """Whether a hop that failed with ``exc`` says its agent is gone or wedged (to be
    left out of walks a while): its answer broke off, or it said nothing within the
    hop, a ``whole`` one (a hop cut short by the asker's own budget proves nothing)."""
    return isinstance(exc, Unanswered) and (whole or not isinstance(exc, Silent))


def pause_after(asked: float) -> None:
    """Sleep what is left of :data:`REASK_S` since ``asked`` (a monotonic time): the
    pause before asking again an agent whose download goes on."""
    time.sleep(max(0.0, REASK_S - (time.monotonic() - asked)))


def budget_for(hop: float) -> float:
    """The budget an agent asked within ``hop`` seconds is given (see
    :data:`ANSWER_MARGIN_S`)."""
    return hop - min(ANSWER_MARGIN_S, hop / 4)


class _Connection(http.client.HTTPConnection):
    """One connection: a short connect bound, then ``timeout`` for the whole answer."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        self.endpoint = endpoint
        self.unix_path = endpoint[len("unix:"):] if endpoint.startswith("unix:") else None
        host, port = ("localhost", 0) if self.unix_path else _host_port(endpoint)
        super().__init__(host, port or None, timeout=timeout)
        self.read_timeout = timeout

    def connect(self) -> None:
        bound = min(CONNECT_TIMEOUT_S, self.read_timeout)
        if self.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(bound)
            try:
                sock.connect(self.unix_path)
                _check_listener(sock, self.unix_path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.host, self.port), bound)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.read_timeout)
        self.sock = sock


def _check_listener(sock: socket.socket, path: str) -> None:
    """Refuse a Unix socket whose listener is not this user's: in a pool directory
    other users may write to, one could rename a socket of their own over the agent's.
    The kernel's record of the listener (``SO_PEERCRED``), one call per connection.

    Raises:
        PermissionError: another user (root included, unless this is root) listens;
            the hop fails as one to an agent that is not there.
    """
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                    struct.calcsize("3i")))
    if uid != os.geteuid():
        raise PermissionError(f"{path} is served by uid {uid}, not by this user "
                              f"(uid {os.geteuid()}): not this job's agent")


def _host_port(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a peer endpoint: {endpoint!r}")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def request(endpoint: str, key: bytes, path: str, *, timeout: float, deadline: str = "",
            most: int | None = None,
            signed: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One signed GET (``deadline``, the budget it gives the agent, signed with it;
    ``signed``: the headers :func:`~distcache.peer._auth.sign` made for it, else made here):
    the status, the headers and the body, the whole answer within
    ``timeout`` (each read waits only for what is left of it), its body at most
    ``most`` bytes (``None``: ``DISTCACHE_MAX_ARTIFACT_BYTES``, as the HTTP origin).

    Raises:
        PeerError: no connection, or an answer longer than ``most`` (:class:`Wrong`)
            (``status`` None: the walk leaves the agent out for a while), or no whole
            answer within ``timeout`` (``status`` 0: :class:`Unanswered` when the answer
            broke off or its head did not come whole in time, even when the socket's
            shutting at the end ended it); ``refused`` False.
    """
    until = time.monotonic() + timeout
    bound = (most, "") if most is not None else (setting("max_artifact_bytes"),
                                                 MAX_ANSWER_VARIABLE)
    conn = _Connection(endpoint, timeout)
    cut: Cut | None = None
    try:
        try:
            conn.connect()
        except OSError as exc:  # nobody there: status None, the walk marks it down
            raise PeerError(f"agent {endpoint}: {type(exc).__name__}: {exc}",
                            endpoint=endpoint, status=None, refused=False) from None
        # Each read waits only for what is left; past the end, the socket is shut, so
        # that a status line or headers sent a byte at a time end in time too. The
        # socket is kept here: an answer that closes the connection (HTTP/1.0, no
        # length) is read after http.client has let go of it.
        sock = conn.sock
        headed = False  # the status line and headers came
        try:
            cut = Cut(sock, until)
            if signed is None:
                signed = sign(key, "GET", path, target=target_of(endpoint), deadline=deadline)
            conn.request("GET", path, headers=signed)
            _left(sock, until)
            # Closed however the body ends: an answer cut short holds the socket.
            with conn.getresponse() as answer:
                # A head cut off by the shut socket reads as ended: it did not come.
                headed = not cut.fired
                if not headed:
                    raise TimeoutError("no whole status line and headers in time")
                if answer.status == 200 or answer.length != 0:
                    # A body to read (an agent's refusals announce none): only once the
                    # agent signed the answer for this request, whatever its status.
                    _check_signed(endpoint, key, signed, answer)
                body = _body(endpoint, sock, answer, until, bound)
                return answer.status, {k.lower(): v for k, v in answer.getheaders()}, body
        except RuntimeError as exc:  # no thread for the cut: nothing said of the agent
            raise PeerError(f"agent {endpoint}: {type(exc).__name__}: {exc}",
                            endpoint=endpoint, status=0, refused=False) from None
        except (OSError, http.client.HTTPException) as exc:
            raise _unanswered(endpoint, exc, cut is not None and cut.fired, headed) from None
    finally:
        if cut is not None:
            cut.cancel()
        conn.close()


def _check_signed(endpoint: str, key: bytes, signed: dict[str, str],
                  answer: http.client.HTTPResponse) -> None:
    """Refuse an answer with a body (the bytes, or what no agent sends with a refusal)
    unless the agent signed it for this request, before any of it is read: the status
    and where the bytes came from (``200``), else the reason, as the agent signs them.

    Raises:
        Unsigned: it is not signed so.
    """
    said = answer.getheader(HEADER_SOURCE if answer.status == 200 else HEADER_REASON) or ""
    if not answer_signed(key, signed, answer.status, said, answer.getheader(HEADER_ANSWER)):
        raise Unsigned(f"agent {endpoint} answered {answer.status} without this job's "
                       "signature of it: its body was not read", endpoint=endpoint,
                       status=0, refused=False)


def _unanswered(endpoint: str, exc: BaseException, cut: bool, headed: bool) -> PeerError:
    """What an answer that did not come whole says of its agent (``cut``: the
    answer's time ran out and its socket was shut; ``headed``: its head came)."""
    text = f"agent {endpoint}: {type(exc).__name__}: {exc}"
    if not (cut or isinstance(exc, TimeoutError)):  # closed, reset, or garbage
        if not headed and isinstance(exc, ConnectionError | http.client.RemoteDisconnected):
            # Closed before a word: what an agent at its connection cap does (it
            # shuts a connection it will not serve), a busy one, not a gone one.
            return PeerError(text, endpoint=endpoint, status=0, refused=False)
        return Unanswered(text, endpoint=endpoint, status=0, refused=False)
    if not headed:  # nothing said within the whole time: stopped or wedged
        return Silent(text, endpoint=endpoint, status=0, refused=False)
    # Its head came, its body did not in time: a slow answer, not one to leave out.
    return PeerError(text, endpoint=endpoint, status=0, refused=False)


class Cut:
    """Shuts ``sock`` when ``until`` passes, unless cancelled first: never after
    :meth:`cancel` returns (the descriptor may belong to another socket by then).
    ``fired``: whether it shut it."""

    def __init__(self, sock: socket.socket, until: float) -> None:
        self._sock, self._done, self._lock = sock, False, threading.Lock()
        self.fired = False
        self._timer = threading.Timer(max(0.0, until - time.monotonic()), self._shut)
        self._timer.daemon = True
        self._timer.start()

    def _shut(self) -> None:
        with self._lock:
            if not self._done:
                self.fired = True
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()


def _left(sock: socket.socket, until: float) -> None:
    """Let the next read wait only for what is left of the answer's time."""
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError("no whole answer in time")
    sock.settimeout(left)


def _body(endpoint: str, sock: socket.socket, answer: http.client.HTTPResponse,
          until: float, bound: tuple[int, str]) -> bytes:
    """The answer's body, read as it comes (a length it announces is not allocated
    ahead) into one buffer handed over whole (``BytesIO.getvalue`` shares it, no
    second copy), refused past ``bound``: at most so many bytes, and the variable
    that set it (``""``: the size asked for)."""
    most = bound[0]
    announced = answer.length
    if announced is not None and announced > most:
        raise _over(endpoint, f"announced {announced} bytes, more than", bound)
    body, got = io.BytesIO(), 0
    while True:
        _left(sock, until)
        chunk = answer.read1(_READ_BYTES)  # what one receive brings, not a whole 1 MiB
        if not chunk:
            if announced is not None and got < announced:  # the peer went away
                raise http.client.IncompleteRead(body.getvalue(), announced - got)
            return body.getvalue()
        got += len(chunk)
        if got > most:
            raise _over(endpoint, "sent more than", bound)
        body.write(chunk)


def _over(endpoint: str, what: str, bound: tuple[int, str]) -> PeerError:
    most, variable = bound
    limit = (f"the {most} bytes asked for" if not variable else
             f"the cap of {most} bytes for an artifact of unknown size ({variable}={most}; "
             f"give the artifact's size, or raise {variable} if it really is this large)")
    return Wrong(f"agent {endpoint} {what} {limit}", endpoint=endpoint, status=None,
                 refused=False)


def fetch(endpoint: str, key: bytes, artifact: Artifact, *, fill: bool, timeout: float,
          deadline: float | None = None, join: bool = False) -> Answer:
    """The verified bytes of ``artifact`` from the agent at ``endpoint``. With ``fill``,
    an agent that does not hold them may get them (its owner walk, or the origin); with
    ``join`` too, only from a download of them that runs already (it starts none).

    Raises:
        ArtifactNotFound: the origin behind the agent has no such artifact (an answer
            the agent signed for this request).
        Filling: its download of the artifact goes on (signed so for this request).
        Unsigned: any answer but a 403 without the agent's signature of it.
        Wrong: bytes that are not the artifact's (``refused``), or too many of them.
        PeerError: refused (``refused``: unauthenticated, not held), or no answer
            within ``timeout``.
    """
    sha = artifact.sha256
    path = (f"/v1/objects/{sha}" + (f"?fill={quote(artifact.name, safe='')}" if fill else "")
            + ("&join=1" if fill and join else ""))
    budget = "" if deadline is None else f"{deadline:.3f}"
    signed = sign(key, "GET", path, target=target_of(endpoint), deadline=budget)
    status, headers, body = request(endpoint, key, path, timeout=timeout, deadline=budget,
                                    most=artifact.size, signed=signed)
    if status == 200:
        if sha256_hex(body) != sha:
            raise Wrong(f"agent {endpoint} sent bytes that are not {sha}",
                        endpoint=endpoint, status=status, sha256=sha, refused=True)
        return Answer(body, headers.get(HEADER_SOURCE.lower(), "pool"))
    reason = headers.get(HEADER_REASON.lower(), "")
    # An agent signs every answer to a request it authenticated; only its 403, to one
    # it could not (another run secret, a clock far off), is bare. Any other answer
    # without its signature (a redirect, a status no agent sends, an unsigned 404 or
    # 503) comes from something else at its endpoint: skipped and left out a while.
    if status != 403 and not answer_signed(key, signed, status, reason,
                                           headers.get(HEADER_ANSWER.lower())):
        raise Unsigned(f"agent {endpoint} answered {status} {reason}".rstrip()
                       + " without this job's signature of it: not an agent of this job "
                       "(another process on its port, or another run secret); not taken "
                       "as final", endpoint=endpoint, status=status, sha256=sha,
                       refused=False)
    if status == 404 and reason == NOT_AT_ORIGIN:
        raise ArtifactNotFound(f"{artifact.name}: the origin behind agent {endpoint} has no "
                               "such artifact", name=artifact.name, status=404)
    if status == 503 and reason == FILLING:
        raise Filling(f"agent {endpoint} is still downloading {artifact.name}",
                      endpoint=endpoint, status=status, sha256=sha, refused=False)
    raise PeerError(f"agent {endpoint} answered {status} {reason}".rstrip(), endpoint=endpoint,
                    status=status, sha256=sha, refused=status in (403, 404))
