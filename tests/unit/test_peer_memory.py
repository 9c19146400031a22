"""What a node agent and its client hold in memory: an answer from the pool is read
only once a transfer slot is taken for it, and a peer's answer of unknown size is
capped at DISTCACHE_MAX_ARTIFACT_BYTES and never copied whole."""

from __future__ import annotations

import os
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import PeerError, PoolError
from distcache.peer import Agent, derive_key, fetch
from distcache.store import ArtifactPool
from tests.unit.test_peer_agent import _bad_peer

KEY = derive_key(b"s" * 32)
MIB = 1 << 20


def _until(what: object, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not what() and time.monotonic() < end:  # type: ignore[operator]
        time.sleep(0.01)


def test_a_held_object_is_read_only_once_a_transfer_slot_is_taken_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache.peer import _agent

    data = os.urandom(256 * 1024)
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(data)
    art = Artifact("big.cubin", sha256_hex(data))
    agent = Agent(pool, lambda: None, KEY, max_transfers=1).start()
    agent.join([agent.endpoint], 0)
    reads: list[str] = []
    looked, real_get = [0], pool.get

    def counting_has(sha: str) -> bool:
        looked[0] += 1
        return ArtifactPool.has(pool, sha)

    def counting_get(sha: str, **kwargs: bool) -> bytes | None:
        reads.append(sha)
        return real_get(sha, **kwargs)

    monkeypatch.setattr(pool, "has", counting_has)
    monkeypatch.setattr(pool, "get", counting_get)
    try:
        agent._slots.acquire()  # the one transfer slot is taken
        with ThreadPoolExecutor(4) as ex:
            asked = [ex.submit(fetch, agent.endpoint, KEY, art, fill=False, timeout=20,
                               deadline=20.0) for _ in range(4)]
            # Every request has arrived (or, before the fix, read the object).
            _until(lambda: looked[0] + len(reads) >= 4)
            time.sleep(0.3)
            assert reads == [] and not any(f.done() for f in asked)
            agent._slots.release()
            got = [f.result(20) for f in asked]
        assert all(g.data == data and g.source == "pool" for g in got)
        assert len(reads) == 4 and agent.counts["served"] == 4 and agent.counts["busy"] == 0
        # The slot goes back when the read finds nothing or fails: the next is served.
        monkeypatch.setattr(pool, "get", lambda sha, **kw: None)
        with pytest.raises(PeerError) as missing:
            fetch(agent.endpoint, KEY, art, fill=False, timeout=10)
        assert missing.value.status == 404  # type: ignore[attr-defined]

        def failing(sha: str, **kwargs: bool) -> bytes | None:
            raise PoolError("unreadable")

        monkeypatch.setattr(pool, "get", failing)
        with pytest.raises(PeerError) as failed:
            fetch(agent.endpoint, KEY, art, fill=False, timeout=10)
        assert failed.value.status == 503 and agent.counts["errors"] == 1  # type: ignore[attr-defined]
        monkeypatch.setattr(pool, "get", real_get)
        monkeypatch.setattr(_agent, "BUSY_WAIT_S", 0.1)
        assert fetch(agent.endpoint, KEY, art, fill=False, timeout=10, deadline=0.2).data == data
        assert agent.counts["busy"] == 0
    finally:
        agent.stop()


@pytest.mark.parametrize("head", [b"", b"Content-Length: 3145728\r\n"],
                         ids=["unannounced", "announced"])
def test_an_answer_of_unknown_size_is_capped_at_the_configured_artifact_limit(
    monkeypatch: pytest.MonkeyPatch, head: bytes
) -> None:
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", str(MIB))
    body = b"y" * (3 * MIB)
    endpoint, _ = _bad_peer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + head + b"\r\n" + body)
    with pytest.raises(PeerError, match=f"{MIB} bytes.*DISTCACHE_MAX_ARTIFACT_BYTES") as over:
        fetch(endpoint, KEY, Artifact("k.cubin", sha256_hex(body)), fill=True, timeout=10)
    assert over.value.status is None  # type: ignore[attr-defined]


def test_an_answer_of_unknown_size_is_not_copied_whole() -> None:
    data = os.urandom(16 * MIB)
    endpoint, _ = _bad_peer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + data)
    art = Artifact("k.cubin", sha256_hex(data))
    tracemalloc.start()
    try:
        got = fetch(endpoint, KEY, art, fill=True, timeout=20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.data == data and type(got.data) is bytes
    size = len(data)
    assert peak < 1.6 * size, f"{peak / MIB:.1f} MiB held for a 16 MiB answer"
