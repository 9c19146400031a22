"""The node agent, its client, rendezvous hashing, singleflight and authentication,
with real agents on loopback and the counting loopback origin."""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ArtifactNotFound, PeerError
from distcache.origins import HttpOrigin
from distcache.peer import (
    Agent,
    Singleflight,
    Tier,
    _client,
    derive_key,
    fetch,
    host_agent,
    lookup,
    order,
    owner,
    sign,
    target_of,
    verify,
)
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts

KEY = derive_key(b"s" * 32)


@pytest.fixture
def made(tmp_path: Path) -> list[Artifact]:
    return make_artifacts(tmp_path / "repo", 6, min_size=1_000, max_size=4_000)


@pytest.fixture
def origin(tmp_path: Path, made: list[Artifact]) -> Iterator[LoopbackOrigin]:
    with LoopbackOrigin(tmp_path / "repo", latency=0.05) as served:
        yield served


def _agents(tmp_path: Path, url: str, n: int) -> list[Agent]:
    agents = [host_agent(ArtifactPool(tmp_path / f"pool{i}"), lambda: HttpOrigin(url), KEY,
                         f"node{i}") for i in range(n)]
    endpoints = [a.endpoint for a in agents]
    for i, agent in enumerate(agents):
        agent.join(endpoints, i)
    return agents


def _stop(agents: list[Agent]) -> None:
    for agent in agents:
        agent.stop()


def test_rendezvous_order_is_shared_and_a_leaving_node_moves_only_what_it_owned() -> None:
    nodes = [f"tcp://10.0.0.{i}:7000" for i in range(8)]
    shas = [sha256_hex(str(i).encode()) for i in range(400)]
    owners = {sha: owner(sha, nodes) for sha in shas}
    assert owners == {sha: owner(sha, list(nodes)) for sha in shas}
    assert len(set(owners.values())) == 8  # spread over every node
    gone = nodes[3]
    rest = [n for n in nodes if n != gone]
    for sha in shas:
        before = nodes[owners[sha]]
        after = rest[owner(sha, rest)]
        if before != gone:
            assert after == before
        else:
            assert after == nodes[order(sha, nodes)[1]]


def test_singleflight_runs_the_work_once_for_concurrent_callers() -> None:
    flight: Singleflight[int] = Singleflight()
    gate = threading.Event()
    runs = []

    def work() -> int:
        runs.append(1)
        gate.wait(5)
        return 42

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(flight.do, "k", work) for _ in range(8)]
        while flight.led + flight.joined < 8:
            threading.Event().wait(0.01)
        gate.set()
        assert [f.result() for f in futures] == [42] * 8
    assert len(runs) == 1 and flight.joined == 7
    assert flight.do("k", lambda: 7) == 7  # a later call runs anew


def test_a_signature_binds_key_method_path_time_and_target() -> None:
    to = "tcp://10.0.0.1:4000"
    headers = sign(KEY, "GET", "/v1/objects/ab", target=to, now=1000.0)
    assert verify(KEY, "GET", "/v1/objects/ab", headers, target=to, now=1000.0) is None
    assert verify(KEY, "GET", "/v1/objects/ac", headers, target=to,
                  now=1000.0) == "a wrong signature"
    assert verify(derive_key(b"t" * 32), "GET", "/v1/objects/ab", headers, target=to,
                  now=1000.0)
    assert verify(KEY, "GET", "/v1/objects/ab", headers, target=to,
                  now=2000.0) == "a time 1000 s off"
    assert verify(KEY, "GET", "/v1/objects/ab", {}, target=to,
                  now=1000.0) == "no authentication headers"
    for other in ("tcp://10.0.0.2:4000", "tcp://10.0.0.1:4001", "unix"):
        assert verify(KEY, "GET", "/v1/objects/ab", headers, target=other,
                      now=1000.0) == "a wrong signature"
    # A node's own agent over its socket: whatever the path's spelling.
    assert target_of("unix:/a/b/.peer") == target_of("unix:/a/./b/.peer") == "unix"
    assert target_of(to) == to
    assert b"s" * 32 not in repr(headers).encode()


def _raw_get(endpoint: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_without_the_secret_or_for_an_unheld_sha_an_agent_gives_only_a_refusal(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin
) -> None:
    (agent,) = _agents(tmp_path, origin.url, 1)
    try:
        held, unheld = made[0], made[1]
        agent.pool.put((tmp_path / "repo" / held.name).read_bytes(), held.sha256)
        path = f"/v1/objects/{held.sha256}"
        assert _raw_get(agent.endpoint, path, {}) == (403, b"")
        wrong = sign(derive_key(b"x" * 32), "GET", path, target=agent.endpoint)
        assert _raw_get(agent.endpoint, path, wrong) == (403, b"")
        replayed = sign(KEY, "GET", f"/v1/objects/{unheld.sha256}", target=agent.endpoint)
        assert _raw_get(agent.endpoint, path, replayed) == (403, b"")
        signed = sign(KEY, "GET", path, target=agent.endpoint, deadline="5.000")
        status, body = _raw_get(agent.endpoint, path, signed)
        assert status == 200 and sha256_hex(body) == held.sha256
        # The same request again, or with its deadline changed on the way: refused.
        assert _raw_get(agent.endpoint, path, signed) == (403, b"")
        stretched = {**sign(KEY, "GET", path, target=agent.endpoint, deadline="5.000"),
                     "X-Distcache-Deadline": "300.000"}
        assert _raw_get(agent.endpoint, path, stretched) == (403, b"")
        assert agent.counts["refused_replay"] == 1
        path = f"/v1/objects/{unheld.sha256}"
        assert _raw_get(agent.endpoint, path,
                        sign(KEY, "GET", path, target=agent.endpoint)) == (404, b"")
        with pytest.raises(PeerError) as refused:
            fetch(agent.endpoint, KEY, unheld, fill=False, timeout=5)
        assert refused.value.refused is True  # type: ignore[attr-defined]
        assert origin.total_requests == 0
        assert agent.counts["refused_auth"] == 4 and agent.counts["refused_missing"] == 2
    finally:
        agent.stop()


def test_the_agent_listens_only_on_the_address_it_was_given(
    tmp_path: Path, origin: LoopbackOrigin
) -> None:
    agent = Agent(ArtifactPool(tmp_path / "pool"), lambda: None, KEY, host="127.0.0.2").start()
    try:
        port = int(agent.endpoint.rsplit(":", 1)[1])
        assert agent.endpoint == f"tcp://127.0.0.2:{port}"
        for other in ("127.0.0.1", "127.0.0.3"):
            with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
                pass
        with socket.create_connection(("127.0.0.2", port), timeout=2):
            pass
    finally:
        agent.stop()


def test_concurrent_misses_on_every_node_cost_one_origin_request_per_artifact(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin
) -> None:
    agents = _agents(tmp_path, origin.url, 4)
    try:
        tiers = [Tier(a.local_endpoint or "", KEY) for a in agents]
        asks = [(tier, artifact) for tier in tiers for artifact in made for _ in range(2)]
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda ask: lookup(ask[1], ask[0]), asks))
        assert all(g is not None and sha256_hex(g.data) == a.sha256
                   for g, (_, a) in zip(got, asks, strict=True))
        assert origin.total_requests == len(made)
        sources = [g.source for g in got if g is not None]
        assert sources.count("origin") + sources.count("peer") + sources.count("pool") == len(asks)
        assert sum(a.counts["origin"] for a in agents) == len(made)
        # Each other node copies each artifact from its owner: once, or twice when its
        # second ask came before the first copy was published; never from the origin.
        assert 3 * len(made) <= sum(a.counts["peer"] for a in agents) <= 6 * len(made)
        # Every node's pool comes to hold every artifact (copies are published beside
        # the answer, on a thread).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
                agent.pool.has(a.sha256) for agent in agents for a in made):
            time.sleep(0.02)
        assert all(agent.pool.has(a.sha256) for agent in agents for a in made)
    finally:
        _stop(agents)


def test_an_owner_that_is_gone_is_skipped_and_one_next_node_asks_the_origin(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin
) -> None:
    agents = _agents(tmp_path, origin.url, 4)
    endpoints = [a.endpoint for a in agents]
    dead = agents[owner(made[0].sha256, endpoints)]
    dead.stop()
    owned = [a for a in made if endpoints[owner(a.sha256, endpoints)] == dead.endpoint]
    live = [a for a in agents if a is not dead]
    try:
        asks = [(Tier(a.local_endpoint or "", KEY), art) for a in live for art in made]
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda ask: lookup(ask[1], ask[0]), asks))
        assert all(g is not None and sha256_hex(g.data) == a.sha256
                   for g, (_, a) in zip(got, asks, strict=True))
        assert origin.total_requests == len(made)  # the dead node's share: one node each
        assert sum(a.counts["fallback"] for a in live) == len(owned)
    finally:
        _stop(live)


def test_an_artifact_the_origin_lacks_is_final_and_costs_one_request(
    tmp_path: Path, origin: LoopbackOrigin
) -> None:
    agents = _agents(tmp_path, origin.url, 2)
    try:
        missing = Artifact("cubins/none.cubin", sha256_hex(b"nothing"))
        for agent in agents:
            with pytest.raises(ArtifactNotFound):
                lookup(missing, Tier(agent.local_endpoint or "", KEY))
        assert origin.total_requests <= 2
    finally:
        _stop(agents)


def test_no_tier_answers_none_at_once(made: list[Artifact]) -> None:
    assert lookup(made[0], Tier("unix:/nonexistent/agent.sock", KEY, bound=2)) is None


def test_a_signature_that_is_not_ascii_is_a_wrong_signature_not_an_error() -> None:
    from distcache.peer._auth import HEADER_AUTH

    headers = {**sign(KEY, "GET", "/v1/objects/ab", target="unix", now=1000.0),
               HEADER_AUTH: "\u00e9" * 64}
    assert verify(KEY, "GET", "/v1/objects/ab", headers, target="unix",
                  now=1000.0) == "a wrong signature"


def test_a_node_whose_agent_cannot_listen_goes_without_one_and_nobody_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.comm import ThreadGroup
    from distcache.peer import _hosting

    real = _hosting.host_agent

    def failing(pool: ArtifactPool, *args: object, **kwargs: object) -> Agent:
        if "node-b" in str(pool.root):
            raise OSError(98, "Address already in use")
        return real(pool, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_hosting, "host_agent", failing)
    group = ThreadGroup(2, ["node-a", "node-b"], timeout=10)
    out: list[object] = [None, None]

    def body(rank: int) -> None:
        pool = ArtifactPool(tmp_path / f"pool-node-{'ab'[rank]}")
        try:
            out[rank] = _hosting.start(group.comm(rank), pool, lambda: None, b"s" * 32,
                                       timeout=10)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    hosted_a, hosted_b = out
    try:
        assert isinstance(hosted_a, _hosting.Hosted) and isinstance(hosted_b, _hosting.Hosted)
        assert hosted_a.agent is not None and hosted_a.tier is not None
        assert hosted_b.agent is None and hosted_b.tier is None
        assert hosted_a.nodes == [hosted_a.agent.endpoint]
    finally:
        for hosted in (hosted_a, hosted_b):
            if isinstance(hosted, _hosting.Hosted):
                hosted.close()


def test_an_idle_connection_is_closed_by_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.peer import _agent

    monkeypatch.setattr(_agent, "HOP_S", 0.5)
    agent = Agent(ArtifactPool(tmp_path / "pool"), lambda: None, KEY, host="127.0.0.1").start()
    try:
        host, port = agent.endpoint[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as idle:
            idle.settimeout(10)
            # An idle client sends nothing; the agent hangs up instead of keeping a
            # thread on it for ever.
            assert idle.recv(1) == b""
    finally:
        agent.stop()


def test_a_pool_path_too_long_for_a_socket_leaves_no_directory_behind(tmp_path: Path) -> None:
    from distcache.peer._hosting import Hosted

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    pool = ArtifactPool(deep / "pool")
    agent = host_agent(pool, lambda: None, KEY, "node0")
    assert agent.socket_path is not None
    made = agent.socket_path.parent
    assert made != Path(pool.root) and made.is_dir()  # the private directory it made
    Hosted(None, agent).close()
    assert not made.exists()


def test_endpoints_handed_down_by_the_leaders_need_no_round_and_an_unshared_start_stops(
    tmp_path: Path,
) -> None:
    from distcache.comm import ThreadGroup
    from distcache.errors import WireError
    from distcache.peer import _hosting

    group = ThreadGroup(2, ["node-a", "node-b"], timeout=10)
    began: list[object] = [None, None]

    def begin(rank: int) -> None:
        pool = ArtifactPool(tmp_path / f"pool-node-{'ab'[rank]}")
        began[rank] = _hosting.begin(group.comm(rank), pool, lambda: None, b"s" * 32,
                                     timeout=10)

    threads = [threading.Thread(target=begin, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    starting = [s for s in began if isinstance(s, _hosting.Starting)]
    assert len(starting) == 2  # one rank per node: both lead
    # The leaders' all-gather (what the delegate's word carries), then each finishes
    # without a collective of its own.
    entries: list[object] = [None, None]

    def among(rank: int) -> None:
        entries[rank] = starting[rank].among_leaders(group.comm(rank))

    threads = [threading.Thread(target=among, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert entries[0] == entries[1] and len(entries[0]) == 2  # type: ignore[arg-type]
    with pytest.raises(WireError, match="malformed"):
        starting[1].received([("node-b", 7, "")])
    for rank in range(2):
        starting[rank].received(entries[rank])
    hosted = [s.finish() for s in starting]  # no all-gather: the threads are gone
    try:
        assert all(h.agent is not None and h.tier is not None for h in hosted)
        assert hosted[0].nodes == hosted[1].nodes
    finally:
        for h in hosted:
            h.close()


def test_a_start_that_is_never_shared_stops_its_agent(tmp_path: Path) -> None:
    from distcache.comm import local
    from distcache.peer import _hosting

    pool = ArtifactPool(tmp_path / "pool")
    starting = _hosting.Starting(local(), b"k" * 32, 10,
                                 lambda: _hosting.host_agent(pool, lambda: None, b"k" * 32,
                                                             "solo", {}))
    agent = starting._started()
    assert agent is not None and agent.socket_path is not None
    socket = agent.socket_path
    assert socket.exists()
    starting.abandon()
    assert not socket.exists() and starting._started() is None


def test_a_leaders_agent_starts_after_the_origin_set_up(tmp_path: Path) -> None:
    import threading

    from distcache.comm import local
    from distcache.peer import _hosting

    pool = ArtifactPool(tmp_path / "pool")
    release = threading.Event()
    order: list[str] = []

    def set_up() -> None:
        release.wait(30)
        order.append("set-up")

    first = threading.Thread(target=set_up)
    first.start()

    def starter() -> _hosting.Agent:
        order.append("agent")
        return _hosting.host_agent(pool, lambda: None, b"k" * 32, "after", {})

    starting = _hosting.Starting(local(), b"k" * 32, 10, starter, first)
    assert starting._thread is not None
    starting._thread.join(0.2)
    assert order == [] and starting._thread.is_alive()  # waiting for the set-up
    release.set()
    agent = starting._started()
    first.join(30)
    try:
        assert order == ["set-up", "agent"] and agent is not None
    finally:
        starting.abandon()


def test_a_lookup_before_the_join_waits_for_it_and_costs_the_job_one_origin_request(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin
) -> None:
    agents = [host_agent(ArtifactPool(tmp_path / f"pool{i}"), lambda: HttpOrigin(origin.url),
                         KEY, f"node{i}") for i in range(2)]
    endpoints = [a.endpoint for a in agents]
    try:
        asks = [(Tier(a.local_endpoint or "", KEY, bound=10), art)
                for a in agents for art in made]
        with ThreadPoolExecutor(len(asks)) as pool:
            futures = [pool.submit(lookup, art, tier) for tier, art in asks]
            time.sleep(0.3)  # every lookup is at an agent that knows no other
            assert origin.total_requests == 0
            for i, agent in enumerate(agents):
                agent.join(endpoints, i)
            got = [f.result() for f in futures]
        assert all(g is not None and sha256_hex(g.data) == a.sha256
                   for g, (_, a) in zip(got, asks, strict=True))
        assert origin.total_requests == len(made)  # not one per node
    finally:
        _stop(agents)


def test_an_agent_never_joined_answers_as_one_node_after_its_join_wait_within_the_budget(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from distcache.peer import _agent

    monkeypatch.setattr(_agent, "JOIN_WAIT_S", 0.5)
    agent = host_agent(ArtifactPool(tmp_path / "pool"), lambda: HttpOrigin(origin.url), KEY,
                       "node0")
    try:
        started = time.monotonic()
        got = [lookup(art, Tier(agent.local_endpoint or "", KEY, bound=10)) for art in made[:2]]
        took = time.monotonic() - started
    finally:
        agent.stop()
    assert all(g is not None and g.source == "origin" for g in got)
    assert origin.total_requests == 2
    assert took >= 2 * 0.5  # each waited for a join that never came
    assert took < 10  # not the lookups' whole budget: the origin was asked in time
    told = [r for r in caplog.records if "was not joined" in r.getMessage()]
    assert len(told) == 1  # said once, not per request


def test_the_agents_socket_is_this_users_alone_without_touching_the_process_umask(
    tmp_path: Path, made: list[Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import stat

    # The umask is the process's: the prefetch's threads create the pool's directories
    # and objects while the agent starts, and would get the socket's mode.
    def no_umask(mask: int) -> int:
        raise AssertionError(f"os.umask({mask:o}) while threads may be creating files")

    monkeypatch.setattr(os, "umask", no_umask)
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"held")
    agent = host_agent(pool, lambda: None, KEY, "node0")
    try:
        assert agent.socket_path is not None
        mode = os.stat(agent.socket_path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        # Nothing left at the name it was bound at, and it answers where it was moved.
        assert sorted(p.name for p in agent.socket_path.parent.iterdir()
                      if stat.S_ISSOCK(p.lstat().st_mode)) == [agent.socket_path.name]
        held = Artifact("held.cubin", sha256_hex(b"held"))
        got = lookup(held, Tier(agent.local_endpoint or "", KEY, bound=5))
        assert got is not None and got.data == b"held" and got.source == "pool"
    finally:
        agent.stop()
    assert not agent.socket_path.exists()


def test_an_agent_whose_endpoints_cannot_be_shared_is_stopped_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    from distcache.errors import CollectiveTimeout
    from distcache.peer._hosting import Starting

    pool = ArtifactPool(tmp_path / "pool")
    started: list[Agent] = []

    def starter() -> Agent:
        started.append(host_agent(pool, lambda: None, KEY, "node0/x"))
        return started[-1]

    class _Timing:  # the all-gather of the endpoints times out on this rank
        node_id, rank, size = "node0", 0, 2

        def allgather_object(self, obj: object, *, timeout: float | None = None) -> object:
            raise CollectiveTimeout("allgather_object timed out", op="allgather_object")

    starting = Starting(_Timing(), KEY, 1.0, starter)  # type: ignore[arg-type]
    with pytest.raises(CollectiveTimeout):
        starting.finish()
    assert len(started) == 1 and started[0].socket_path is not None
    assert not list(Path(pool.root).glob(".peer-*"))  # neither the socket nor its key
    host, port = started[0].endpoint.removeprefix("tcp://").rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):  # nobody listens any more
        socket.create_connection((host, int(port)), 1)


def signed_script(request: bytes, script: bytes, key: bytes = KEY) -> list[bytes | memoryview]:
    """``script`` with a ``200`` answer's head signed for ``request`` as an agent holding
    ``key`` signs it, in pieces to send one after the other (the body is not copied):
    what misbehaves in it then does so past the signature check."""
    if not script.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
        return [script]
    from distcache.peer._auth import HEADER_ANSWER, sign_answer

    def headers(text: bytes) -> dict[str, str]:
        lines = text[:4096].split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
        return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}

    source = headers(script).get(_client.HEADER_SOURCE, "")
    mac = sign_answer(key, headers(request), 200, source)
    end = script.index(b"\r\n")
    return [script[:end], f"\r\n{HEADER_ANSWER}: {mac}".encode(), memoryview(script)[end:]]


def _bad_peer(script: bytes, trickle: int = 0, delay: float = 0.0,
              hold: float = 0.0) -> tuple[str, threading.Thread]:
    """A TCP endpoint that answers one request with ``script`` (a ``200`` signed as
    this job's agent would: :func:`signed_script`) after ``delay`` s, then ``trickle``
    bytes one every 0.3 s, then keeps the connection ``hold`` s."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn, server:
            asked = conn.recv(65536)
            time.sleep(delay)
            with contextlib.suppress(OSError):
                for piece in signed_script(asked, script):
                    conn.sendall(piece)
            for _ in range(trickle):
                time.sleep(0.3)
                with contextlib.suppress(OSError):
                    conn.sendall(b"x")
            time.sleep(hold)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{server.getsockname()[1]}", thread


def test_a_peer_that_trickles_or_announces_too_much_is_bounded_in_time_and_memory() -> None:
    artifact = Artifact("k.cubin", sha256_hex(b"y"))
    # One byte every 0.3 s: each read comes in time, the whole answer does not.
    endpoint, _ = _bad_peer(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n", 20)
    began = time.monotonic()
    with pytest.raises(PeerError) as timed:
        fetch(endpoint, KEY, artifact, fill=True, timeout=1.0, deadline=1.0)
    assert time.monotonic() - began < 3.0 and timed.value.status == 0
    # A length no artifact has is refused before anything is allocated for it.
    endpoint, _ = _bad_peer(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000000\r\n\r\n")
    with pytest.raises(PeerError, match="announced 1000000000000000 bytes") as long:
        fetch(endpoint, KEY, artifact, fill=True, timeout=5.0)
    assert long.value.status is None  # the walk leaves such an agent out for a while
    # An artifact of known size: not one byte more.
    sized = Artifact("k.cubin", sha256_hex(b"y"), size=1)
    endpoint, _ = _bad_peer(b"HTTP/1.1 200 OK\r\n\r\nyy")
    with pytest.raises(PeerError, match="more than the 1 bytes"):
        fetch(endpoint, KEY, sized, fill=True, timeout=5.0)


def test_an_owner_that_fails_in_an_unforeseen_way_is_skipped_and_left_out(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    agents = _agents(tmp_path, origin.url, 2)
    endpoints = [a.endpoint for a in agents]
    real = _client.fetch

    bad = owner(made[0].sha256, endpoints)  # the node that fails owns one at least
    asker = agents[1 - bad]

    def failing(endpoint: str, *args: object, **kwargs: object) -> object:
        if endpoint == endpoints[bad]:
            raise MemoryError("an answer no agent sends")
        return real(endpoint, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_client, "fetch", failing)
    owned = [a for a in made if owner(a.sha256, endpoints) == bad]
    try:
        tier = Tier(asker.local_endpoint or "", KEY, bound=10)
        got = [lookup(a, tier) for a in owned]
    finally:
        _stop(agents)
    assert all(g is not None and g.source == "fallback" for g in got)
    assert asker.counts["fallback"] == len(owned)
    assert asker.counts["peer_skipped"] == 1  # left out of the walks after the first
    assert any("MemoryError" in r.getMessage() for r in caplog.records)


def test_a_peer_that_refuses_the_signature_is_named_once_on_both_sides(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    caplog.set_level(logging.WARNING)
    # Node 1 runs with another secret: every request between them is refused.
    agents = [host_agent(ArtifactPool(tmp_path / f"pool{i}"), lambda: HttpOrigin(origin.url),
                         key, f"node{i}") for i, key in enumerate((KEY, derive_key(b"t" * 32)))]
    endpoints = [a.endpoint for a in agents]
    for i, agent in enumerate(agents):
        agent.join(endpoints, i)
    # Asked from the node that does not own made[0], of what the other owns.
    other = owner(made[0].sha256, endpoints)
    owned = [a for a in made if owner(a.sha256, endpoints) == other]
    try:
        tier = Tier(agents[1 - other].local_endpoint or "",
                    (KEY, derive_key(b"t" * 32))[1 - other], bound=10)
        got = [lookup(a, tier) for a in owned]
    finally:
        _stop(agents)
    assert all(g is not None and g.source == "fallback" for g in got)
    assert agents[other].counts["refused_auth"] == len(owned)
    said = [r.getMessage() for r in caplog.records]
    assert sum("refused this node's request (403)" in m for m in said) == 1
    assert sum("refused a request from" in m for m in said) == 1


def test_an_answer_waits_for_a_transfer_slot_as_long_as_its_asker_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.peer import _agent

    # A 503 "busy" sends the asker to the next node, which may ask the origin for
    # bytes this agent holds: the answer waits for a slot within the asker's budget.
    monkeypatch.setattr(_agent, "BUSY_WAIT_S", 0.1)
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"held")
    agent = Agent(pool, lambda: None, KEY, socket_path=tmp_path / "a.sock",
                  max_transfers=1).start()
    agent.join([agent.endpoint], 0)
    held = Artifact("held.cubin", sha256_hex(b"held"))
    try:
        agent._slots.acquire()  # the one transfer slot is taken
        with ThreadPoolExecutor(1) as ex:
            asked = ex.submit(lookup, held, Tier(agent.local_endpoint or "", KEY, bound=10))
            time.sleep(0.6)  # past BUSY_WAIT_S, within the asker's budget
            agent._slots.release()
            got = asked.result(10)
    finally:
        agent.stop()
    assert got is not None and got.data == b"held"
    assert agent.counts["busy"] == 0 and agent.counts["served"] == 1


def test_connections_that_send_nothing_hold_at_most_the_agents_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.peer import _servers

    monkeypatch.setattr(_servers, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(_servers, "PER_NODE", 1)
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(b"held")
    agent = Agent(pool, lambda: None, KEY).start()
    agent.join([agent.endpoint], 0)
    host, port = agent.endpoint.removeprefix("tcp://").rsplit(":", 1)
    held = Artifact("held.cubin", sha256_hex(b"held"))
    listener = agent._servers[0]  # the TCP one
    idle = [socket.create_connection((host, int(port)), 2) for _ in range(2)]
    try:
        deadline = time.monotonic() + 20  # both accepted, each holding a handler thread
        while getattr(listener, "_open", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        with socket.create_connection((host, int(port)), 2) as third:
            third.settimeout(5)
            assert third.recv(1) == b""  # closed at once, not left waiting
        for conn in idle:
            conn.close()
        deadline = time.monotonic() + 20  # the idle handlers end as their peers close
        while getattr(listener, "_open", 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        got = fetch(agent.endpoint, KEY, held, fill=False, timeout=5)
        assert got.data == b"held"
    finally:
        for conn in idle:
            conn.close()
        agent.stop()
    assert getattr(listener, "turned_away", None) == 1 and agent.counts["served"] == 1


def _raw_request(endpoint: str, lines: list[str]) -> bytes:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), 10) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        conn.settimeout(10)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def test_a_header_sent_twice_or_a_deadline_no_clock_has_is_refused(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"held")
    agent = Agent(pool, lambda: None, KEY).start()
    agent.join([agent.endpoint], 0)
    path = f"/v1/objects/{sha}"
    try:
        signed = sign(KEY, "GET", path, target=agent.endpoint, deadline="5.000")
        # Another nonce (or deadline) put before the signed one: the signature would
        # be checked against one copy and the other used.
        for extra in ("X-Distcache-Nonce: 00", "x-distcache-deadline: 300.000"):
            answer = _raw_request(agent.endpoint, [
                f"GET {path} HTTP/1.1", "Host: x", "Connection: close", extra,
                *(f"{k}: {v}" for k, v in signed.items())])
            assert answer.startswith(b"HTTP/1.0 403") or answer.startswith(b"HTTP/1.1 403")
        assert agent.counts["refused_auth"] == 2
        status, _ = _raw_get(agent.endpoint, path, signed)  # the request itself: fine
        assert status == 200
        status, _ = _raw_get(agent.endpoint, path,
                             sign(KEY, "GET", path, target=agent.endpoint, deadline="nan"))
        assert status == 503 and agent.counts["errors"] == 1
    finally:
        agent.stop()


def test_a_status_line_sent_a_byte_at_a_time_or_a_body_cut_short_ends_the_hop() -> None:
    artifact = Artifact("k.cubin", sha256_hex(b"y"))
    endpoint, _ = _bad_peer(b"H", 20)  # then "x" every 0.3 s: never a whole status line
    began = time.monotonic()
    with pytest.raises(PeerError) as slow:
        fetch(endpoint, KEY, artifact, fill=True, timeout=1.0)
    assert time.monotonic() - began < 3.0 and slow.value.status == 0
    # An answer without a length (read until the peer closes), its head sent just
    # before the bound, then nothing: it ends at the bound, not a read's timeout later.
    endpoint, _ = _bad_peer(b"HTTP/1.0 200 OK\r\n\r\n", delay=1.8, hold=10)
    began = time.monotonic()
    with pytest.raises(PeerError):
        fetch(endpoint, KEY, artifact, fill=True, timeout=2.0)
    assert time.monotonic() - began < 3.0
    endpoint, _ = _bad_peer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\ny")
    with pytest.raises(PeerError, match="IncompleteRead") as cut:
        fetch(endpoint, KEY, artifact, fill=True, timeout=5.0)
    assert cut.value.status == 0  # went away mid-answer: not "sent other bytes"


def test_a_request_for_one_agent_is_refused_by_another_with_the_same_key(
    tmp_path: Path,
) -> None:
    pools = [ArtifactPool(tmp_path / f"pool-{i}") for i in range(2)]
    sha = pools[0].put(b"held by both")
    pools[1].put(b"held by both")
    agents = [Agent(pool, lambda: None, KEY, host="127.0.0.1",
                    socket_path=Path(pool.root) / ".peer").start() for pool in pools]
    try:
        path = f"/v1/objects/{sha}"
        # Seen on its way to the first agent and sent to the second: refused there, as
        # the second's signature for it would differ. The first still takes it.
        meant = sign(KEY, "GET", path, target=agents[0].endpoint, deadline="5.000")
        assert _raw_get(agents[1].endpoint, path, meant) == (403, b"")
        assert agents[1].counts["refused_auth"] == 1 and agents[1].counts["served"] == 0
        status, body = _raw_get(agents[0].endpoint, path, meant)
        assert status == 200 and body == b"held by both"
        # The client signs for the agent it asks; a node's own socket is "unix".
        assert fetch(agents[1].endpoint, KEY, Artifact("x", sha), fill=False,
                     timeout=5).data == b"held by both"
        local = agents[1].local_endpoint
        assert local is not None
        assert fetch(local, KEY, Artifact("x", sha), fill=False,
                     timeout=5).data == b"held by both"
    finally:
        for agent in agents:
            agent.stop()


def test_a_request_head_trickled_a_byte_at_a_time_is_cut_at_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from distcache.peer import _agent, _servers

    monkeypatch.setattr(_servers, "HEAD_S", 1.0)
    assert _agent.HOP_S == 20.0  # each read may wait that long: the head bound cuts
    pool = ArtifactPool(tmp_path / "pool")
    sha = pool.put(b"held")
    agent = Agent(pool, lambda: None, KEY, host="127.0.0.1").start()
    try:
        path = f"/v1/objects/{sha}"
        head = "".join(f"{line}\r\n" for line in [
            f"GET {path} HTTP/1.1", "Host: x",
            *(f"{k}: {v}" for k, v in sign(KEY, "GET", path,
                                           target=agent.endpoint).items())]) + "\r\n"
        host, port = agent.endpoint[len("tcp://"):].rsplit(":", 1)
        with caplog.at_level("WARNING", logger="distcache"), \
                socket.create_connection((host, int(port)), timeout=10) as slow:
            began = time.monotonic()
            closed_at = None
            for byte in head.encode():  # 0.1 s a byte: minutes for the whole head
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed_at = time.monotonic()
                    break
                slow.settimeout(0.1)
                try:
                    got = slow.recv(64)
                except TimeoutError:
                    continue
                except OSError:
                    got = b""
                assert got == b""  # nothing answered: the connection was closed
                closed_at = time.monotonic()
                break
            assert closed_at is not None and closed_at - began < 3.0
        # Counted by the agent's thread just after it shut the connection.
        until = time.monotonic() + 5
        while agent.counts["cut_head"] == 0 and time.monotonic() < until:
            time.sleep(0.01)
        assert agent.counts["cut_head"] == 1 and agent.counts["refused_auth"] == 0
        assert sum("did not send a whole request within 1 s" in r.getMessage()
                   for r in caplog.records) == 1
        # A request sent at once is served as before.
        status, body = _raw_get(agent.endpoint, path,
                                sign(KEY, "GET", path, target=agent.endpoint))
        assert (status, body) == (200, b"held")
    finally:
        agent.stop()


def test_a_fill_that_finds_the_object_published_meanwhile_answers_from_the_pool(
    tmp_path: Path, made: list[Artifact], origin: LoopbackOrigin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (agent,) = _agents(tmp_path, origin.url, 1)
    try:
        art = made[0]
        # Another process of the node publishes it right after the agent looked.
        agent.pool.put((tmp_path / "repo" / art.name).read_bytes(), art.sha256)
        looked = agent.pool.get
        first = [True]

        def missed_once(sha: str) -> bytes | None:
            if first[0]:
                first[0] = False
                return None
            return looked(sha)

        monkeypatch.setattr(agent.pool, "get", missed_once)
        got = fetch(agent.endpoint, KEY, art, fill=True, timeout=5)
        assert sha256_hex(got.data) == art.sha256 and got.source == "pool"
        assert origin.total_requests == 0 and agent.counts["origin"] == 0
        # A real miss still counts the origin.
        got = fetch(agent.endpoint, KEY, made[1], fill=True, timeout=5)
        assert got.source == "origin" and agent.counts["origin"] == 1
        assert origin.total_requests == 1
    finally:
        agent.stop()


def test_a_request_that_stops_waiting_for_anothers_fill_is_told_it_goes_on(
    tmp_path: Path, made: list[Artifact],
) -> None:
    """Not an error, nor a plain 503: a signed "filling", so that the asker asks this
    agent again instead of the next node, which would ask the origin once more."""
    with LoopbackOrigin(tmp_path / "repo", latency=2.0) as slow:
        (agent,) = _agents(tmp_path, slow.url, 1)
        try:
            art = made[0]
            with ThreadPoolExecutor(1) as pool:
                filling = pool.submit(fetch, agent.endpoint, KEY, art, fill=True,
                                      timeout=10, deadline=10.0)
                time.sleep(0.5)  # the first request's fill is under way
                with pytest.raises(_client.Filling) as late:
                    fetch(agent.endpoint, KEY, art, fill=True, timeout=5, deadline=0.5)
                assert late.value.status == 503  # type: ignore[attr-defined]
                assert agent.counts["filling"] == 1 and agent.counts["errors"] == 0
                assert agent.counts["unavailable"] == 0
                assert sha256_hex(filling.result().data) == art.sha256
            assert slow.total_requests == 1 and agent.counts["origin"] == 1
        finally:
            agent.stop()
