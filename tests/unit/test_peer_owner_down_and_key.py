"""An owner that breaks off or says nothing for a whole hop is left out of later walks
(docs/peers.md, 'A silent owner is skipped'), and the agent's request key file is
written where nothing planted at its name is followed or kept (docs/security.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import pytest

from distcache.artifact import Artifact
from distcache.errors import OriginError
from distcache.origins import DirOrigin, HttpOrigin
from distcache.peer import Agent, Tier, fetch, host_agent, lookup, order
from distcache.peer import _tier as peer_tier
from distcache.peer._hosting import Hosted, socket_path
from distcache.peer._tier import key_path
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.unit.test_peer_agent import (
    KEY,
    _bad_peer,
    origin,  # noqa: F401  (a fixture)
)
from tests.unit.test_peer_memory import _until

#: A short hop, so that a silent owner costs the test about a second.
HOP_S = 1.0


@pytest.fixture
def made(tmp_path: Path) -> list[Artifact]:
    # Enough that a node of two owns several, whatever port it was given.
    return make_artifacts(tmp_path / "repo", 24, min_size=500, max_size=1_000)


@pytest.fixture
def short_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.peer import _agent

    monkeypatch.setattr(_agent, "HOP_S", HOP_S)


@contextlib.contextmanager
def _asker_beside(owner: str, tmp_path: Path, url: str) -> Iterator[Agent]:
    """This node's agent, in a job of two whose other node is ``owner``."""
    agent = host_agent(ArtifactPool(tmp_path / "pool"), lambda: HttpOrigin(url), KEY, "asker")
    agent.join([owner, agent.endpoint], 1)
    try:
        yield agent
    finally:
        agent.stop()


@contextlib.contextmanager
def _slow_owner(tmp_path: Path, url: str) -> Iterator[tuple[Agent, Agent, LoopbackOrigin]]:
    """An owner agent whose origin answers in three hops, this node's agent beside it
    (its origin at ``url``), the two joined; and the slow origin."""
    with LoopbackOrigin(tmp_path / "repo", latency=3 * HOP_S) as slow:
        owner = host_agent(ArtifactPool(tmp_path / "owner"), lambda: HttpOrigin(slow.url),
                           KEY, "owner")
        try:
            with _asker_beside(owner.endpoint, tmp_path, url) as agent:
                owner.join([owner.endpoint, agent.endpoint], 0)
                yield owner, agent, slow
        finally:
            owner.stop()


def _owned_by(node: int, ring: list[str], made: list[Artifact]) -> list[Artifact]:
    return [a for a in made if order(a.sha256, ring)[0] == node]


@pytest.mark.parametrize("script", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10,  # cut short
    b"SSH-2.0-OpenSSH_9.6\r\n",  # not an answer at all
], ids=["cut-short", "garbage"])
def test_an_owner_whose_answer_breaks_off_is_left_out_of_later_walks(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None, script: bytes,
) -> None:
    bad, peer = _bad_peer(script)
    with _asker_beside(bad, tmp_path, origin.url) as agent:
        owned = _owned_by(0, [bad, agent.endpoint], made)[:3]
        assert len(owned) == 3
        got = [lookup(a, Tier(agent.local_endpoint or "", KEY, bound=10)) for a in owned]
    peer.join(10)  # asked once, it has answered: no thread left to a later test
    assert not peer.is_alive()
    assert [g and g.source for g in got] == ["fallback"] * 3
    # Asked by the first walk only; the next node asked the origin for each.
    assert agent.counts["peer_skipped"] == 1 and agent.counts["fallback"] == 3
    assert origin.total_requests == 3


def test_an_owner_that_closes_before_a_word_is_taken_for_a_busy_one_and_asked_again(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None,
) -> None:
    # What an agent at its connection cap does: it shuts each connection it will not
    # serve, without a word.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def turn_away() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                conn.close()

    turning = threading.Thread(target=turn_away, daemon=True)
    turning.start()
    bad = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    with _asker_beside(bad, tmp_path, origin.url) as agent:
        owned = _owned_by(0, [bad, agent.endpoint], made)[:3]
        got = [lookup(a, Tier(agent.local_endpoint or "", KEY, bound=10)) for a in owned]
    assert [g and g.source for g in got] == ["fallback"] * 3
    server.shutdown(socket.SHUT_RDWR)  # wakes its accept(), which a close() would not
    server.close()
    turning.join(10)
    assert not turning.is_alive()
    assert agent.counts["peer_skipped"] == 3 and agent.counts["fallback"] == 3


def test_a_silent_owner_is_left_out_once_it_was_given_a_whole_hop(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None,
) -> None:
    # Reads the request, then says nothing (a stopped or wedged process: the kernel
    # still accepts connections for it, into the backlog).
    bad, peer = _bad_peer(b"", hold=4 * HOP_S)
    with _asker_beside(bad, tmp_path, origin.url) as agent:
        first, second, third = _owned_by(0, [bad, agent.endpoint], made)[:3]
        # A hop cut short by the asker's own budget proves nothing of the owner.
        lookup(first, Tier(agent.local_endpoint or "", KEY, bound=HOP_S / 2))
        _until(lambda: agent.counts["fallback"] == 1)  # the walk went on past it
        assert agent.counts["peer_skipped"] == 1
        tier = Tier(agent.local_endpoint or "", KEY, bound=10)
        got = [lookup(a, tier) for a in (second, third)]
    assert [g and g.source for g in got] == ["fallback"] * 2
    # Asked again by the second walk, which gave it a whole hop; not by the third.
    assert agent.counts["peer_skipped"] == 2
    peer.join(10)  # its hold over: no thread left to a later test
    assert not peer.is_alive()


def test_an_owner_still_filling_says_so_within_the_hop_and_is_waited_for(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None, caplog: pytest.LogCaptureFixture,
) -> None:
    """An owner whose origin download takes longer than a hop says so (a signed 503
    "filling") within it, and is asked again: the next node would ask the origin a
    second time for the same artifact."""
    caplog.set_level(logging.DEBUG, logger="distcache.peer")
    with _slow_owner(tmp_path, origin.url) as (owner, agent, slow):
        owned = _owned_by(0, [owner.endpoint, agent.endpoint], made)[:2]
        # The owner's fills, begun by other nodes: longer than a hop.
        with ThreadPoolExecutor(len(owned)) as others:
            fills = [others.submit(fetch, owner.endpoint, KEY, a, fill=True, timeout=10)
                     for a in owned]
            _until(lambda: slow.total_requests == len(owned))
            tier = Tier(agent.local_endpoint or "", KEY, bound=10)
            got = [lookup(a, tier) for a in owned]
            assert [f.result().source for f in fills] == ["origin"] * 2
    assert [g and g.source for g in got] == ["peer"] * 2
    assert [g and g.data for g in got] == [
        (tmp_path / "repo" / a.name).read_bytes() for a in owned]
    # One origin request per artifact in the job: the owner's.
    assert slow.total_requests == 2 and origin.total_requests == 0
    assert agent.counts["fallback"] == 0 and agent.counts["peer_skipped"] == 0
    # A busy owner is not taken for a silent one, nor left out.
    assert owner.counts["filling"] >= 1 and agent.counts["peer_filling"] >= 1
    assert not agent._down.down(owner.endpoint)
    said = [r.getMessage() for r in caplog.records]
    assert any("is still downloading" in m for m in said), said


def test_an_owner_leading_a_slow_fill_for_its_first_asker_serves_it_when_done(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None,
) -> None:
    with _slow_owner(tmp_path, origin.url) as (owner, agent, slow):
        first, held = _owned_by(0, [owner.endpoint, agent.endpoint], made)[:2]
        owner.pool.put((tmp_path / "repo" / held.name).read_bytes())
        owner.pool.remember([held])
        tier = Tier(agent.local_endpoint or "", KEY, bound=10)
        # The owner leads this fill itself, longer than a hop: it says so within the
        # hop, the download goes on, and the asker asks again until it is served.
        assert (got := lookup(first, tier)) is not None and got.source == "peer"
        assert owner.counts["filling"] >= 1 and owner.counts["origin"] == 1
        assert not agent._down.down(owner.endpoint)
        again = lookup(held, tier)
    assert again is not None and again.source == "peer"
    assert slow.total_requests == 1 and origin.total_requests == 0
    assert agent.counts["fallback"] == 0


def test_a_lookup_whose_bound_ends_while_the_owner_downloads_waits_on_that_download(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None,
) -> None:
    """The walk ends within the lookup's bound without a fallback download of its own,
    saying the owner's goes on; the lookup asks again, past its bound, to wait on that
    download only (the loader asking the origin itself would download it once more)."""
    with _slow_owner(tmp_path, origin.url) as (owner, agent, slow):
        (first,) = _owned_by(0, [owner.endpoint, agent.endpoint], made)[:1]
        waited = peer_tier.counts["waited"]
        began = time.monotonic()
        got = lookup(first, Tier(agent.local_endpoint or "", KEY, bound=1.2))
        took = time.monotonic() - began
        assert owner.counts["filling"] >= 1 and agent.counts["filling"] >= 1
    assert got is not None and got.source == "peer"
    assert got.data == (tmp_path / "repo" / first.name).read_bytes()
    assert peer_tier.counts["waited"] > waited and took > 1.2  # past its bound
    assert slow.total_requests == 1 and origin.total_requests == 0
    assert agent.counts["fallback"] == 0 and agent.counts["unavailable"] == 0


class _Failing(DirOrigin):
    """An origin whose every download fails after ``seconds``; ``calls`` counted."""

    def __init__(self, root: Path, seconds: float) -> None:
        super().__init__(root)
        self.seconds, self.calls = seconds, 0

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        self.calls += 1
        time.sleep(self.seconds)
        raise OriginError(f"{artifact.name}: the origin broke off", name=artifact.name)


def test_a_waiting_lookup_starts_no_download_when_the_owners_fails(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None,
) -> None:
    """Waiting past its bound, a lookup only joins the download that runs: once it
    fails, no ask starts another, at the owner or here."""
    failing = _Failing(tmp_path / "repo", 3 * HOP_S)
    owner = host_agent(ArtifactPool(tmp_path / "owner"), lambda: failing, KEY, "owner")
    try:
        with _asker_beside(owner.endpoint, tmp_path, origin.url) as agent:
            owner.join([owner.endpoint, agent.endpoint], 0)
            (first,) = _owned_by(0, [owner.endpoint, agent.endpoint], made)[:1]
            began = time.monotonic()
            assert lookup(first, Tier(agent.local_endpoint or "", KEY, bound=1.2)) is None
            took = time.monotonic() - began
            assert owner.counts["filling"] >= 1 and agent.counts["fallback"] == 0
    finally:
        owner.stop()
    assert failing.calls == 1 and origin.total_requests == 0
    assert 3 * HOP_S <= took < 3 * HOP_S + 2.5  # ended with the download that failed


def test_a_lookup_stops_waiting_after_the_filling_wait(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,  # noqa: F811
    short_hop: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(peer_tier, "FILLING_WAIT_S", 1.0)
    with _slow_owner(tmp_path, origin.url) as (owner, agent, slow):
        (first,) = _owned_by(0, [owner.endpoint, agent.endpoint], made)[:1]
        failed = peer_tier.counts["failed"]
        assert lookup(first, Tier(agent.local_endpoint or "", KEY, bound=0.6)) is None
        assert peer_tier.counts["failed"] == failed + 1
        _until(lambda: owner.pool.has(first.sha256))
    assert slow.total_requests == 1 and origin.total_requests == 0


# --- the key file ------------------------------------------------------------------


def _key_file(pool: ArtifactPool, tag: str) -> Path:
    return key_path(socket_path(Path(pool.root), tag))


@pytest.mark.parametrize("planted", ["link", "group-writable file"])
def test_nothing_planted_at_the_key_files_name_is_written_through_or_kept(
    tmp_path: Path, planted: str
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    name = _key_file(pool, "node0")
    elsewhere = tmp_path / "elsewhere.key"  # a co-writer's file, outside the pool
    elsewhere.write_bytes(b"")
    os.chmod(elsewhere, 0o664)
    if planted == "link":
        os.symlink(elsewhere, name)
    else:
        name.write_bytes(b"")
        os.chmod(name, 0o666)
    before = name.lstat()
    agent = host_agent(pool, lambda: None, KEY, "node0")
    try:
        st = name.lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_ino != before.st_ino  # a new file, not the planted one
        assert name.read_bytes() == KEY
        assert elsewhere.read_bytes() == b""  # nothing written through the link
    finally:
        Hosted(None, agent).close()
    assert not name.exists() and not list(Path(pool.root).glob(".peer-*"))


def test_closing_removes_only_the_key_file_this_agent_made(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    agent = host_agent(pool, lambda: None, KEY, "node0")
    assert agent.socket_path is not None
    name = key_path(agent.socket_path)
    theirs = name.with_name("theirs")
    theirs.write_bytes(b"another's")
    os.replace(theirs, name)  # put at the name since (the pool is shared)
    Hosted(None, agent).close()
    assert name.read_bytes() == b"another's"
    assert not agent.socket_path.exists()


def test_the_key_is_in_place_before_the_agent_listens_and_a_failed_start_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    seen: list[bytes] = []

    def failing(agent: Agent) -> Agent:  # before its listeners: a process finding
        assert agent.socket_path is not None  # its socket finds the key beside it
        name = key_path(agent.socket_path)
        seen.append(name.read_bytes() if name.exists() else b"")
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(Agent, "start", failing)
    with pytest.raises(OSError, match="Address already in use"):
        host_agent(pool, lambda: None, KEY, "node0")
    assert seen == [KEY]
    assert not list(Path(pool.root).glob(".peer-*"))


def test_a_node_already_downloading_an_artifact_waits_on_that_not_on_another_walk(
    tmp_path: Path, made: list[Artifact], short_hop: None,
) -> None:
    """A lookup whose bound ends while this node's agent downloads (its fallback for a
    silent owner) waits on that download, without asking the owners again."""
    bad, peer = _bad_peer(b"", hold=4 * HOP_S)
    with LoopbackOrigin(tmp_path / "repo", latency=2 * HOP_S) as slow, \
            _asker_beside(bad, tmp_path, slow.url) as agent:
        (first,) = _owned_by(0, [bad, agent.endpoint], made)[:1]
        # The owner is given less than a hop (not left out for it), then the fallback
        # download begins, longer than this lookup's bound.
        got = lookup(first, Tier(agent.local_endpoint or "", KEY, bound=1.2))
        assert got is not None and got.source == "fallback"
        assert agent.counts["peer_skipped"] == 1  # the owner was not asked again
        assert agent.counts["filling"] >= 1
    assert slow.total_requests == 1 and agent.counts["fallback"] == 1
    peer.join(10)
    assert not peer.is_alive()
