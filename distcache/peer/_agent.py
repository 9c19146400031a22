"""The node agent: serves its node's pool to the job's other agents and to its own
node's processes, and is the one place per node that asks an owner or the origin.

``http.server.ThreadingHTTPServer`` on two listeners: TCP bound to one address (the
one the job uses, never a wildcard) for the other nodes, and a Unix socket for the
node's own processes. One route, ``GET /v1/objects/<sha256>[?fill=<name>[&join=1]]``:

- every request is authenticated (:mod:`distcache.peer._auth`); one that is not gets
  403 and nothing else; every answer closes its connection, and one that is not the
  object's bytes is signed (:mod:`distcache.peer._answers`);
- an object the pool holds is read verified (``ArtifactPool.get``) in a transfer slot
  and sent; one it does not hold gets 404, unless ``fill`` names it;
- ``fill`` from another node: this agent is asked as an owner, and asks the origin
  itself (once per sha256 however many ask at once: :class:`Singleflight`), if it is
  among the first ``1 + fallbacks`` nodes of the artifact's rendezvous order;
- ``fill`` from this node (the Unix socket): the owner walk. The nodes before this one
  in the artifact's order are asked in turn, each skipped when it does not answer
  within a short bound (and kept out of later walks for :data:`DOWN_S`); when none
  answers, this node asks the origin if its place allows (``origin`` when it owns the
  artifact, ``fallback`` otherwise). Bytes from anywhere are verified and published
  into the pool before they are sent on.
- ``join`` with ``fill``: only from a download that runs already, here or at the
  nodes that may download the artifact; none is started (a lookup waiting past its
  bound on the download it was told goes on).

At most ``max_transfers`` answers are sent at once; more wait for a slot up to what is
left of the request's budget (at least :data:`BUSY_WAIT_S`), then get 503: an asker
turned away would go to the next node in the order, which may ask the origin for
bytes this one already holds. Every outcome is counted in :attr:`Agent.counts`.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.errors import ArtifactNotFound, DistcacheError, PeerError
from distcache.origins._base import Asked
from distcache.peer import _client
from distcache.peer._answers import handler as _handler
from distcache.peer._auth import MAX_SKEW_S, Nonces
from distcache.peer._backoff import Backoff
from distcache.peer._flight import Singleflight, StillRunning, flight_key
from distcache.peer._ring import order
from distcache.peer._servers import TcpServer, close_connections, private_socket

if TYPE_CHECKING:
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = get_logger(__name__)

#: Seconds a node that did not answer is left out of owner walks, doubled while it
#: fails each time it is asked again, up to DOWN_MAX_S; its first answer ends it.
DOWN_S, DOWN_MAX_S = 10.0, 160.0
#: Seconds an answer waits for a transfer slot, at least, before a 503.
BUSY_WAIT_S = 5.0
#: Seconds one hop to another agent may take (its origin download included).
HOP_S = 20.0
#: Seconds left to a walk, at least, for it to ask an owner still downloading again.
REASK_HOP_S = 0.5
#: Seconds a request may take when the asker gives no budget.
DEFAULT_BUDGET_S = 30.0
#: Seconds a filling request waits, at most, for an agent that will be joined to the
#: job's agents (and never more than half its budget); past it, as an agent of one node.
JOIN_WAIT_S = 5.0


class Agent:
    """One node's agent. :meth:`start` it, tell it the job's nodes with
    :meth:`join`, :meth:`stop` it when the job ends.

    Args:
        pool: the node's pool.
        origin: returns the origin to fill from (``None``: this agent never asks one).
        key: the request key (:func:`distcache.peer.derive_key`).
        host: the one address the TCP listener binds.
        socket_path: the Unix socket for the node's processes (``None``: none).
        max_transfers: answers sent at once.
        fallbacks: how many nodes after an artifact's owner may ask the origin for it
            when the owner does not answer (the per-job cap of the fallback).
    """

    def __init__(self, pool: ArtifactPool, origin: Callable[[], Origin | None], key: bytes, *,
                 host: str = "127.0.0.1", socket_path: Path | None = None,
                 max_transfers: int = 16, fallbacks: int = 1, joining: bool = False) -> None:
        self.pool = pool
        self.origin = origin
        self.key = key
        self.host = host
        self.socket_path = socket_path
        self.fallbacks = fallbacks
        self.nodes: list[str] = []
        self.me = -1
        # Both at once, for the request threads: nodes and this one's index in them.
        self._ring: tuple[list[str], int] = ([], -1)
        # Set by join(). An agent that will be joined (``joining``: a node agent of a
        # job) holds a filling request until then, for at most JOIN_WAIT_S: a member's
        # init may return a moment before its leader's has joined the agent to the
        # job's, and an agent that knows no other takes every artifact for its own.
        self._joined = threading.Event()
        if not joining:
            self._joined.set()
        self._told: set[str] = set()  # what was logged at WARNING once (see _first)
        self._nonces = Nonces()
        self.counts: Counter[str] = Counter()
        self._slots = threading.BoundedSemaphore(max_transfers)
        self._lock = threading.Lock()
        self._down = Backoff()
        self._walks: Singleflight[_client.Answer] = Singleflight()
        self._fills: Singleflight[_client.Answer] = Singleflight()
        self._servers: list[http.server.ThreadingHTTPServer] = []
        self._endpoint = ""
        #: Set by :meth:`stop`: a request read as it stops gets no answer.
        self.stopped = False

    @property
    def endpoint(self) -> str:
        """``tcp://HOST:PORT`` of the TCP listener (set by :meth:`start`)."""
        return self._endpoint

    @property
    def local_endpoint(self) -> str | None:
        return f"unix:{self.socket_path}" if self.socket_path is not None else None

    def start(self) -> Agent:
        handler = _handler(self, hop_s=HOP_S, budget_s=DEFAULT_BUDGET_S)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        tcp = type("_Tcp", (TcpServer,), {"address_family": family})((self.host, 0), handler)
        self._servers.append(tcp)
        host, port = tcp.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        self._endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        if self.socket_path is not None:
            try:
                self._servers.append(private_socket(self.socket_path, handler))
            except BaseException:  # nothing serves yet: close the listener, not shut down
                tcp.server_close()
                self._servers.clear()
                raise
        for server in self._servers:
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                             daemon=True, name="distcache-peer-agent").start()
        return self

    def join(self, nodes: Sequence[str], me: int) -> None:
        """The job's agents (TCP endpoints, the same list on every node) and this one's index."""
        self.nodes, self.me = list(nodes), me
        self._ring = (self.nodes, me)
        for server in self._servers:
            if isinstance(server, TcpServer):
                server.joined(len(self.nodes))
        self._joined.set()

    def stop(self) -> None:
        """Stop listening and shut the connections being served: no request on them is
        taken up from then on (one already being answered ends on its own)."""
        self.stopped = True
        for server in self._servers:
            server.shutdown()
            server.server_close()  # a Unix socket's name too, while it is still this one
            close_connections(server)
        self._servers.clear()

    def count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1

    # --- what a request gets ------------------------------------------------------

    def answer(self, artifact: Artifact, *, fill: bool, local: bool, budget: float,
               join: bool = False) -> _client.Answer | None:
        """The answer with a transfer slot taken for it (the caller sends it, then
        releases ``_slots``), or ``None``: no slot within the wait. A held object is
        read in its slot (not a copy per waiting request), a fill's shared bytes before.
        ``join``: fill only from a download that runs already, here or (local) at the
        owners; start none.
        Raises: ArtifactNotFound, PeerError (refused when not held and not filled),
        StillRunning (the download waited on goes on)."""
        until = time.monotonic() + budget
        def slot() -> bool:  # waits as long as the asker does (see BUSY_WAIT_S)
            return self._slots.acquire(timeout=max(BUSY_WAIT_S, until - time.monotonic()))
        if (held := self.pool.has(artifact.sha256)) and not slot():
            return None
        data = None
        try:
            data = self.pool.get(artifact.sha256) if held else None
        finally:
            if held and data is None:  # gone, corrupt or unreadable since: no slot kept
                self._slots.release()
        if data is not None:
            return _client.Answer(data, "pool")
        if not fill:
            raise PeerError("not held", sha256=artifact.sha256, status=404, refused=True)
        if not self._joined.wait(min(JOIN_WAIT_S, budget / 2)) and self._first("unjoined"):
            log.warning("peers: %s was not joined to the job's agents within %.1f s; "
                        "answering %s as an agent of one node", self.endpoint,
                        min(JOIN_WAIT_S, budget / 2), artifact.name)
        budget = max(until - time.monotonic(), 0.001)
        if local:
            got = self._walks.do(flight_key(artifact) + ("#join" if join else ""),
                                 lambda: self._walk(artifact, until, join=join),
                                 timeout=budget)
        elif join:
            running = self._running_fill(artifact, budget)
            if running is None:
                raise PeerError("no download of it runs here", sha256=artifact.sha256,
                                status=404, refused=True)
            got = running
        else:
            position = self._position(artifact)
            if position > self.fallbacks:
                raise PeerError("not an owner of this artifact", sha256=artifact.sha256,
                                status=404, refused=True)
            got = self._fill(artifact, "origin" if position == 0 else "fallback", budget)
        return got if slot() else None

    def _first(self, what: str) -> bool:
        """Whether ``what`` happens for the first time (it is said at WARNING once,
        later at DEBUG)."""
        with self._lock:
            first = what not in self._told
            self._told.add(what)
        return first

    def _position(self, artifact: Artifact) -> int:
        nodes, me = self._ring
        if me < 0:
            return 0
        return order(artifact.sha256, nodes).index(me)

    def _walk(self, artifact: Artifact, until: float, *, join: bool = False
              ) -> _client.Answer:
        """``join``: only from a download that runs already, here or at the nodes that
        may download it (the owner and its fallbacks); none is started."""
        # This agent downloads it already (an asker told it goes on asks again): wait
        # on that, not on another walk that would ask the owners once more.
        joined = self._running_fill(artifact, until - time.monotonic())
        if joined is not None:
            return joined
        nodes, me = self._ring  # one view, whenever join() comes
        ranked = order(artifact.sha256, nodes) if me >= 0 else [0]
        for place, index in enumerate(ranked):
            if join and place > self.fallbacks:
                break
            if index == me or me < 0:
                if join:
                    continue  # not downloading it (looked above): start nothing
                if place > self.fallbacks:
                    break
                return self._fill(artifact, "origin" if place == 0 else "fallback",
                                  until - time.monotonic())
            got = self._from(nodes[index], artifact, until, join=join)
            if got is None:
                continue
            self.count("peer")
            # Published beside the answer, not before it: the asker has verified bytes
            # now, and a lookup that comes before the object lands only copies again.
            threading.Thread(target=self._publish, args=(artifact, got.data), daemon=True,
                             name="distcache-peer-publish").start()
            return _client.Answer(got.data, "peer")
        if join:
            raise PeerError(f"no download of {artifact.name} runs", sha256=artifact.sha256,
                            status=404, refused=True)
        self.count("no_owner")
        raise PeerError(f"no owner of {artifact.name} answered", sha256=artifact.sha256,
                        status=503, refused=False)

    def _from(self, endpoint: str, artifact: Artifact, until: float, *, join: bool = False
              ) -> _client.Answer | None:
        """``artifact`` from the agent at ``endpoint``, asked again for as long as its
        download of it goes on (:class:`~distcache.peer._client.Filling`) and ``until``
        allows; ``None`` when it is skipped (left out of walks a while where it did not
        answer as an agent of this job does).

        Raises:
            ArtifactNotFound: the origin behind it has no such artifact: final.
            StillRunning: ``until`` passed while its download went on: the walk ends
                there rather than have the next node ask the origin too (the asker is
                told so, and may ask again).
        """
        filling = False
        ran_out = StillRunning(f"agent {endpoint} was still downloading {artifact.name} "
                               "when this walk's time ran out")
        while True:
            hop = min(HOP_S, until - time.monotonic())
            if filling and hop < REASK_HOP_S:  # too short for its answer to come back
                raise ran_out
            if hop <= 0 or (not filling and self._down.skip(endpoint, hop)):  # it answers
                return None
            asked = time.monotonic()
            try:
                got = _client.fetch(endpoint, self.key, artifact, fill=True, timeout=hop,
                                    deadline=_client.budget_for(hop), join=join)
                self._down.answered(endpoint)
                return got
            except _client.Filling:
                # Its download goes on: the next node would ask the origin once more.
                filling = True
                self._answered(endpoint)
                self.count("peer_filling")
                log.debug("agent %s is still downloading %s: asked again", endpoint,
                          artifact.name)
                _client.pause_after(asked)
                continue
            except PeerError as exc:
                status = getattr(exc, "status", None)
                if filling and status == 0 and hop < HOP_S and not isinstance(
                        exc, _client.Unanswered):
                    # Asked again with less than a hop left, and the time ran out: it
                    # was downloading, and nothing says it stopped.
                    raise ran_out from None
                wrong = isinstance(exc, _client.Wrong)  # no agent of ours answers so
                down = status is None or wrong or _client.gone(exc, whole=hop >= HOP_S)
                # A busy or refusing agent answers: not left out, its back-off over.
                seconds = self._mark_down(endpoint) if down else self._answered(endpoint)
                self.count("peer_skipped")
                if down and isinstance(exc, _client.Silent) and self._first(f"mute {endpoint}"):
                    log.warning("peers: agent %s said nothing within a whole hop of %.0f s (a "
                                "stopped or wedged process); walks leave it out for %.0f s, "
                                "longer while it stays silent (up to %.0f s), and ask the next "
                                "node in each order", endpoint, hop, seconds, DOWN_MAX_S)
                elif wrong and self._first(f"wrong {endpoint}"):
                    log.warning("peers: %s; what listens at %s is not an agent of this "
                                "job, or a broken one: it is skipped for %.0f s at a time",
                                exc, endpoint, DOWN_S)
                elif status == 403 and self._first(f"refused by {endpoint}"):
                    log.warning("peers: agent %s refused this node's request (403): its "
                                "clock is more than %d s off this one's, or it runs with "
                                "another run secret; what it owns goes to the next node "
                                "in each artifact's order", endpoint, MAX_SKEW_S)
                elif isinstance(exc, _client.Unsigned) and self._first(f"unsigned {endpoint}"):
                    log.warning("peers: %s; what listens at %s is not an agent of this job "
                                "(another process on its port, or another run secret): it "
                                "is skipped for %.0f s at a time", exc, endpoint, DOWN_S)
                else:
                    log.debug("agent %s skipped for %s: %s", endpoint, artifact.name, exc)
                return None
            except ArtifactNotFound:  # signed: the origin behind it has no such artifact
                self._down.answered(endpoint)
                raise
            except Exception as exc:  # an answer no agent of ours sends: not one to ask
                self._mark_down(endpoint)
                self.count("peer_skipped")
                log.warning("peers: agent %s skipped for %s: %s: %s", endpoint,
                            artifact.name, type(exc).__name__, exc)
                return None

    def _running_fill(self, artifact: Artifact, budget: float) -> _client.Answer | None:
        """This agent's running download of ``artifact``, waited on within ``budget``;
        ``None`` when none runs.

        Raises:
            StillRunning: it goes on past ``budget``.
        """
        if not self._fills.running(flight_key(artifact)):
            return None
        return self._fill(artifact, "fallback", budget)  # the running one's answer

    def _fill(self, artifact: Artifact, source: str, budget: float) -> _client.Answer:
        origin = self.origin()
        if origin is None:
            raise PeerError("this agent has no origin", sha256=artifact.sha256, status=503,
                            refused=False)
        def download() -> _client.Answer:
            asked = Asked(origin)
            data = self.pool.fetch(artifact, asked)
            if not asked.asked:  # another process published it since the pool was read
                return _client.Answer(data, "pool")
            self.count(source)
            return _client.Answer(data, source)

        return self._fills.do(flight_key(artifact), download, timeout=max(budget, 0.001),
                              bounded=True)

    def _publish(self, artifact: Artifact, data: bytes) -> None:
        try:
            self.pool.put(data, artifact.sha256)
            self.pool.remember([artifact])
        except DistcacheError as exc:
            log.warning("agent: could not publish %s into %s: %s", artifact.name,
                        getattr(self.pool, "root", self.pool), exc)

    def _mark_down(self, endpoint: str) -> float:
        return self._down.failed(endpoint, DOWN_S, DOWN_MAX_S)

    def _answered(self, endpoint: str) -> float:
        self._down.answered(endpoint)
        return 0.0

