"""A peer that fails in a way no agent of ours does is skipped and left out of walks
for ``DOWN_S`` (docs/peers.md, 'A misbehaving peer is bounded'): one whose status
line and headers do not come whole within the hop, even when it keeps sending them a
byte at a time, and one whose answer carries bytes that are not the artifact's, or
more of them than the artifact has."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import PeerError
from distcache.peer import Tier, _client, fetch, lookup
from distcache.testing import LoopbackOrigin
from tests.unit.test_peer_agent import (
    KEY,
    origin,  # noqa: F401  (a fixture)
    signed_script,
)
from tests.unit.test_peer_owner_down_and_key import (  # noqa: F401  (fixtures)
    HOP_S,
    _asker_beside,
    _owned_by,
    made,
    short_hop,
)

#: Seconds between two bytes of a trickled head: each read comes in time.
TRICKLE_S = 0.05


class _Fake:
    """A TCP endpoint that answers as a broken agent of this job would: each
    connection's request is read, then ``script`` is sent (a ``200`` head signed with
    the job's key, :func:`~tests.unit.test_peer_agent.signed_script`), then ``trickle`` a byte at a time until the connection or the
    fake is shut. ``connections``: how many it took."""

    def __init__(self, script: bytes, trickle: bytes = b"") -> None:
        self.script, self.trickle = script, trickle
        self.connections = 0
        self._stop = threading.Event()
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen()
        self.endpoint = f"tcp://127.0.0.1:{self._server.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._server.accept()
                self.connections += 1
                served = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self._threads.append(served)
                served.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            asked = conn.recv(65536)
            for piece in signed_script(asked, self.script):
                conn.sendall(piece)
            for byte in self.trickle:
                if self._stop.wait(TRICKLE_S):
                    return
                conn.sendall(bytes([byte]))

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown(socket.SHUT_RDWR)  # wakes its accept()
        self._server.close()
        for thread in list(self._threads):
            thread.join(10)
            assert not thread.is_alive()


@contextlib.contextmanager
def _fake(script: bytes, trickle: bytes = b"") -> Iterator[_Fake]:
    fake = _Fake(script, trickle)
    try:
        yield fake
    finally:
        fake.close()


# --- a head that does not come whole -------------------------------------------------

_TRICKLED = (b"HTTP/1.1 200 OK\r\n", b"X-Trickle: " + b"a" * 10_000)


def test_a_head_cut_off_at_the_end_of_the_hop_is_no_head_that_came() -> None:
    artifact = Artifact("k.cubin", sha256_hex(b"y"))
    with _fake(*_TRICKLED) as fake, pytest.raises(_client.Silent) as cut:
        fetch(fake.endpoint, KEY, artifact, fill=True, timeout=0.5)
    assert cut.value.status == 0 and _client.gone(cut.value, whole=True)


def test_a_head_that_came_before_a_slow_body_is_a_slow_answer_not_a_gone_agent() -> None:
    artifact = Artifact("k.cubin", sha256_hex(b"y"))
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n"
    with _fake(head, b"x" * 1000) as fake, pytest.raises(PeerError) as slow:
        fetch(fake.endpoint, KEY, artifact, fill=True, timeout=0.5)
    assert slow.value.status == 0 and not isinstance(slow.value, _client.Unanswered)


def test_an_owner_that_trickles_its_head_is_left_out_of_later_walks(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None,  # noqa: F811
) -> None:
    with _fake(*_TRICKLED) as fake, _asker_beside(fake.endpoint, tmp_path,
                                                  origin.url) as agent:
        owned = _owned_by(0, [fake.endpoint, agent.endpoint], made)[:3]
        assert len(owned) == 3
        tier = Tier(agent.local_endpoint or "", KEY, bound=10)
        got = [lookup(a, tier) for a in owned]
        assert agent._down.down(fake.endpoint)
    assert [g and g.source for g in got] == ["fallback"] * 3
    # Asked by the first walk only, which it cost a whole hop; not by the next two.
    assert fake.connections == 1
    assert agent.counts["peer_skipped"] == 1 and agent.counts["fallback"] == 3
    assert origin.total_requests == 3


# --- bytes that are not the artifact's ------------------------------------------------


@pytest.mark.parametrize(("script", "said"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"z" * 100, "sent bytes that are not"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + b"z" * 5000, "announced 5000 bytes"),
    (b"HTTP/1.0 200 OK\r\n\r\n" + b"z" * 5000, "sent more than"),
], ids=["wrong-bytes", "announced-too-many", "sent-too-many"])
def test_an_owner_that_answers_other_bytes_is_left_out_of_later_walks_and_named(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None,  # noqa: F811
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, script: bytes,
    said: str,
) -> None:
    # A lookup names no size: the cap for an artifact of unknown size bounds the answer.
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", "4096")
    caplog.set_level(logging.WARNING, logger="distcache.peer")
    with _fake(script) as fake, _asker_beside(fake.endpoint, tmp_path, origin.url) as agent:
        owned = _owned_by(0, [fake.endpoint, agent.endpoint], made)[:3]
        assert len(owned) == 3
        tier = Tier(agent.local_endpoint or "", KEY, bound=10)
        got = [lookup(a, tier) for a in owned]
        assert agent._down.down(fake.endpoint)
    assert [g and g.source for g in got] == ["fallback"] * 3
    assert fake.connections == 1
    assert agent.counts["peer_skipped"] == 1 and agent.counts["fallback"] == 3
    assert origin.total_requests == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and fake.endpoint in warned[0] and said in warned[0], warned

