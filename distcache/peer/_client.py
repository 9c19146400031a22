"""Asking a node agent for an object: ``http.client`` over TCP or a Unix socket.

An endpoint is ``tcp://HOST:PORT`` (another node's agent) or ``unix:PATH`` (this
node's). Every request is signed (:mod:`distcache.peer._auth`); every answer's bytes
are checked against the sha256 asked for before they are returned, so a peer can make
a lookup fail but never hand over other bytes.
"""

from __future__ import annotations

import http.client
import socket
from urllib.parse import quote

from distcache._record import Record
from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ArtifactNotFound, PeerError
from distcache.peer._auth import sign

#: Seconds to open a connection to an agent: a live agent accepts at once, so an
#: owner that does not is skipped for the next in rendezvous order.
CONNECT_TIMEOUT_S = 1.0
HEADER_SOURCE = "X-Distcache-Source"
HEADER_REASON = "X-Distcache-Reason"
HEADER_DEADLINE = "X-Distcache-Deadline"
#: The answer's reason when the origin behind the agent has no such artifact.
NOT_AT_ORIGIN = "not-at-origin"


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


class _Connection(http.client.HTTPConnection):
    """One connection: a short connect bound, then ``timeout`` per read."""

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
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.host, self.port), bound)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.read_timeout)
        self.sock = sock


def _host_port(endpoint: str) -> tuple[str, int]:
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a peer endpoint: {endpoint!r}")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)


def request(endpoint: str, key: bytes, path: str, *, timeout: float,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One signed GET: the status, the headers and the body.

    Raises:
        PeerError: no connection (``status`` None), or no answer within ``timeout``
            (``status`` 0); ``refused`` False.
    """
    conn = _Connection(endpoint, timeout)
    try:
        try:
            conn.connect()
        except OSError as exc:  # nobody there: status None, the walk marks it down
            raise PeerError(f"agent {endpoint}: {type(exc).__name__}: {exc}",
                            endpoint=endpoint, status=None, refused=False) from None
        try:
            conn.request("GET", path, headers={**sign(key, "GET", path), **(headers or {})})
            answer = conn.getresponse()
            body = answer.read()
            return answer.status, {k.lower(): v for k, v in answer.getheaders()}, body
        except (OSError, http.client.HTTPException) as exc:
            # Connected, but no whole answer in time: a busy agent (a long origin fill),
            # status 0, not one to leave out of every walk.
            raise PeerError(f"agent {endpoint}: {type(exc).__name__}: {exc}",
                            endpoint=endpoint, status=0, refused=False) from None
    finally:
        conn.close()


def fetch(endpoint: str, key: bytes, artifact: Artifact, *, fill: bool, timeout: float,
          deadline: float | None = None) -> Answer:
    """The verified bytes of ``artifact`` from the agent at ``endpoint``. With ``fill``,
    an agent that does not hold them may get them (its owner walk, or the origin).

    Raises:
        ArtifactNotFound: the origin behind the agent has no such artifact.
        PeerError: refused (``refused``: unauthenticated, not held, bad bytes), or no
            answer within ``timeout``.
    """
    sha = artifact.sha256
    path = f"/v1/objects/{sha}" + (f"?fill={quote(artifact.name, safe='')}" if fill else "")
    extra = {HEADER_DEADLINE: f"{deadline:.3f}"} if deadline is not None else None
    status, headers, body = request(endpoint, key, path, timeout=timeout, headers=extra)
    if status == 200:
        if sha256_hex(body) != sha:
            raise PeerError(f"agent {endpoint} sent bytes that are not {sha}",
                            endpoint=endpoint, status=status, sha256=sha, refused=True)
        return Answer(body, headers.get(HEADER_SOURCE.lower(), "pool"))
    reason = headers.get(HEADER_REASON.lower(), "")
    if status == 404 and reason == NOT_AT_ORIGIN:
        raise ArtifactNotFound(f"{artifact.name}: the origin behind agent {endpoint} has no "
                               "such artifact", name=artifact.name, status=404)
    raise PeerError(f"agent {endpoint} answered {status} {reason}".rstrip(), endpoint=endpoint,
                    status=status, sha256=sha, refused=status in (403, 404))
