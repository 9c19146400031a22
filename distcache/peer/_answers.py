"""What a node agent's listeners answer: the handler of its one route (see
:mod:`distcache.peer._agent`).

Every answer closes its connection (the asker opens one per request): a client can
hold a connection only for as long as one request's head takes (:data:`HEAD_S
<distcache.peer._servers.HEAD_S>`), never from one refusal to the next. An answer to
an authenticated request carries the agent's signature of it
(:func:`distcache.peer._auth.sign_answer`): the asker takes the origin's "no such
artifact" as final only with it, and reads the object's bytes only after it.
"""

from __future__ import annotations

import http.server
import math
import threading
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from distcache._log import get_logger
from distcache.artifact import Artifact, validate_name
from distcache.errors import ArtifactNotFound, DistcacheError, PeerError
from distcache.peer import _client
from distcache.peer._auth import (
    HEADER_ANSWER,
    HEADER_AUTH,
    HEADER_DEADLINE,
    HEADER_NONCE,
    HEADER_TIME,
    Nonces,
    sign_answer,
    verify,
)
from distcache.peer._flight import StillRunning
from distcache.peer._servers import BoundedHead, UnixServer

log = get_logger(__name__)


class Agent(Protocol):
    """What the handler reads of its agent (:class:`distcache.peer._agent.Agent`)."""

    key: bytes
    stopped: bool
    _nonces: Nonces
    _slots: threading.BoundedSemaphore

    @property
    def endpoint(self) -> str: ...

    def count(self, outcome: str) -> None: ...

    def _first(self, what: str) -> bool: ...

    def answer(self, artifact: Artifact, *, fill: bool, local: bool, budget: float,
               join: bool = False) -> _client.Answer | None: ...


def handler(agent: Agent, *, hop_s: float, budget_s: float
            ) -> type[http.server.BaseHTTPRequestHandler]:
    """The request handler of ``agent``: an idle connection closed after ``hop_s``, a
    request without a budget given ``budget_s``."""

    class Handler(BoundedHead):
        protocol_version = "HTTP/1.1"
        server_version = "distcache-peer/1"
        # A connection that sends nothing for this long is closed: an idle client must
        # not hold a server thread for ever.
        timeout = hop_s
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def address_string(self) -> str:
            return str(self.client_address[0]) if self.client_address else "local"

        def head_cut(self, bound: float) -> None:
            first = agent._first("cut_head")
            (log.warning if first else log.debug)(
                "agent %s: closed a connection from %s that did not send a whole request "
                "within %.0f s%s", agent.endpoint, self.address_string(), bound,
                " (later ones are logged at DEBUG)" if first else "")
            agent.count("cut_head")  # after its line: whoever sees the count sees the line

        def _refuse(self, status: int, reason: str, outcome: str,
                    signed: dict[str, str] | None = None) -> None:
            """Answer ``status`` with ``reason`` and close; signed when the request
            was (``signed``: its authentication headers)."""
            agent.count(outcome)
            self.send_response(status)
            self.send_header(_client.HEADER_REASON, reason)
            if signed is not None:
                self.send_header(HEADER_ANSWER, sign_answer(agent.key, signed, status, reason))
            self.send_header("Content-Length", "0")
            self.send_header("Connection", "close")
            self.end_headers()

        def _signed(self) -> tuple[dict[str, str], str | None]:
            """The request's authentication headers, each read once (the values the
            signature is checked against are the ones used after it), and why they
            do not authenticate it (``None``: they do)."""
            signed: dict[str, str] = {}
            for name in (HEADER_TIME, HEADER_NONCE, HEADER_AUTH, HEADER_DEADLINE):
                values = self.headers.get_all(name) or []
                if len(values) > 1:
                    return signed, f"{len(values)} {name} headers"
                if values:
                    signed[name] = values[0]
            target = "unix" if isinstance(self.server, UnixServer) else agent.endpoint
            return signed, verify(agent.key, "GET", self.path, signed, target=target)

        def do_GET(self) -> None:
            self.close_connection = True  # one request per connection, whatever comes
            if agent.stopped:  # a head read as the agent stopped: nothing more is done
                return
            signed, why = self._signed()
            if why is not None:
                # The first at WARNING: a peer whose clock is off or whose run secret
                # differs is refused on every request and its node goes to the origin.
                first = agent._first("refused_auth")
                (log.warning if first else log.debug)(
                    "agent %s: refused a request from %s: %s%s", agent.endpoint,
                    self.address_string(), why,
                    " (later refusals are logged at DEBUG)" if first else "")
                return self._refuse(403, "unauthenticated", "refused_auth")
            if not agent._nonces.first(signed[HEADER_NONCE]):
                first = agent._first("refused_replay")
                (log.warning if first else log.debug)(
                    "agent %s: refused a replayed request from %s", agent.endpoint,
                    self.address_string())
                return self._refuse(403, "unauthenticated", "refused_replay")
            self._route(signed)

        def _route(self, signed: dict[str, str]) -> None:
            parts = urlsplit(self.path)
            sha = parts.path.removeprefix("/v1/objects/")
            query = parse_qs(parts.query)
            if sha == parts.path or len(sha) != 64 or sha.strip("0123456789abcdef"):
                return self._refuse(404, "no-such-route", "refused_route", signed)
            try:
                name = validate_name(query["fill"][0]) if "fill" in query else "object"
                budget = float(signed.get(HEADER_DEADLINE) or budget_s)
                if not math.isfinite(budget):
                    raise ValueError(f"a deadline of {budget} s")
                budget = min(max(budget, 0.001), 300.0)
                got = agent.answer(Artifact(name, sha), fill="fill" in query,
                                   join="fill" in query and query.get("join") == ["1"],
                                   local=isinstance(self.server, UnixServer), budget=budget)
            except ArtifactNotFound:
                return self._refuse(404, _client.NOT_AT_ORIGIN, "not_at_origin", signed)
            except StillRunning:  # the fill goes on: the asker asks again, not elsewhere
                return self._refuse(503, _client.FILLING, "filling", signed)
            except PeerError as exc:
                if getattr(exc, "refused", False):
                    return self._refuse(404, "not-held", "refused_missing", signed)
                return self._refuse(503, "unavailable", "unavailable", signed)  # not a failure
            except (DistcacheError, ValueError, TimeoutError) as exc:
                log.debug("agent: %s failed: %s", sha, exc)
                return self._refuse(503, "unavailable", "errors", signed)
            if got is None:  # no transfer slot within the asker's wait
                return self._refuse(503, "busy", "busy", signed)
            try:  # the slot answer() took for it
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(got.data)))
                self.send_header(_client.HEADER_SOURCE, got.source)
                self.send_header(HEADER_ANSWER, sign_answer(agent.key, signed, 200, got.source))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(got.data)
                agent.count("served")
            finally:
                agent._slots.release()

    return Handler
