"""The move of a prefetch runs beside its downloads: a source sends each object as it
lands, keeps its receivers in step while a download is slow, and a failed download
ends the move with the fetch's error on every rank."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective import prefetch
from distcache.collective._bucket import PAUSE, StreamStats, bucket_messages, decode_bucket
from distcache.comm import ThreadGroup
from distcache.errors import ArtifactNotFound, PrefetchError
from distcache.store._pool import ArtifactPool


class ScriptedOrigin:
    """Serves ``blobs``; the first ``free`` requests at once, the rest (and the
    ``held`` names) once ``release`` is set; ``slow`` names are written in 25 pieces 0.1 s apart; ``missing`` names
    are not found."""

    def __init__(self, blobs: dict[str, bytes], *, free: int | None = None,
                 slow: frozenset[str] = frozenset(), missing: frozenset[str] = frozenset(),
                 held: frozenset[str] = frozenset()) -> None:
        self.blobs = blobs
        self.free = free
        self.held = held
        self.slow = slow
        self.missing = missing
        self.release = threading.Event()
        self.calls = 0
        self.waiting = 0
        self._lock = threading.Lock()

    def describe(self) -> str:
        return "scripted://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        return b"".join(self._pieces(artifact))

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        written = 0
        for piece in self._pieces(artifact):
            out.write(piece)
            written += len(piece)
        return written

    def _pieces(self, artifact: Artifact) -> Any:
        with self._lock:
            self.calls += 1
            gated = ((self.free is not None and self.calls > self.free)
                     or artifact.name in self.held)
            self.waiting += gated
        if gated:
            assert self.release.wait(30), "the test never released the origin"
            with self._lock:
                self.waiting -= 1
        if artifact.name in self.missing:
            raise ArtifactNotFound(f"404 from scripted://origin/{artifact.name}",
                                   artifact=artifact.name, status=404)
        data = self.blobs[artifact.sha256]
        if artifact.name not in self.slow:
            yield data
            return
        step = -(-len(data) // 25)
        for i in range(0, len(data), step):
            time.sleep(0.1)
            yield data[i:i + step]


def make(count: int, size: int = 4000) -> tuple[list[Artifact], dict[str, bytes]]:
    arts, blobs = [], {}
    for i in range(count):
        data = bytes([i]) * size + i.to_bytes(4, "big")
        arts.append(Artifact(f"k{i:02d}.cubin", sha256_hex(data), len(data)))
        blobs[sha256_hex(data)] = data
    return arts, blobs


def start_two(arts: list[Artifact], pools: list[ArtifactPool], origin: ScriptedOrigin,
              timeout: float) -> tuple[list[Any], list[threading.Thread]]:
    """The prefetch of ``arts`` on two rank threads of a ThreadGroup, started now: the
    list their reports (or what they raised) will be in, and the threads."""
    group = ThreadGroup(2, timeout=timeout)
    outcomes: list[Any] = [None, None]

    def main(rank: int) -> None:
        try:
            outcomes[rank] = prefetch(arts, comm=group.comm(rank), pool=pools[rank],
                                      origin=origin, timeout=timeout)
        except BaseException as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    return outcomes, threads


def seen_while_held(origin: ScriptedOrigin, seen: Callable[[], bool]) -> bool:
    """Whether ``seen()`` came true within 15 s while ``origin`` held its gated
    downloads (some must still be held then); the origin is released either way."""
    try:
        deadline = time.monotonic() + 15
        while not seen():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        assert origin.waiting > 0, "every download was answered: nothing was held back"
        return True
    finally:
        origin.release.set()


def succeeded(outcomes: list[Any]) -> None:
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome


def joined(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"


def test_objects_reach_the_other_pool_before_the_last_download_lands(tmp_path: Path) -> None:
    arts, blobs = make(8)
    origin = ScriptedOrigin(blobs, free=2)
    pools = [ArtifactPool(tmp_path / f"pool{r}") for r in range(2)]
    shas = [a.sha256 for a in arts]
    outcomes, threads = start_two(arts, pools, origin, 20)
    # Two downloads are answered, the other six wait: an object that reaches the pool
    # that did not download it was moved while the fetch was still running.
    moved_early = seen_while_held(
        origin, lambda: any(pools[0].has(s) and pools[1].has(s) for s in shas))
    joined(threads)
    assert moved_early, "no object reached the other pool before the held downloads landed"
    succeeded(outcomes)
    assert origin.calls == len(arts)
    assert all(pool.has(s) for pool in pools for s in shas)


def test_objects_travel_in_the_order_they_land_not_behind_a_held_one(tmp_path: Path) -> None:
    arts, blobs = make(8)
    # The first object of the plan's order (objects are ordered by digest) is held: the
    # others land, and each must reach both pools while it waits.
    first = min(arts, key=lambda a: a.sha256)
    origin = ScriptedOrigin(blobs, held=frozenset({first.name}))
    pools = [ArtifactPool(tmp_path / f"pool{r}") for r in range(2)]
    outcomes, threads = start_two(arts, pools, origin, 20)
    others = [a.sha256 for a in arts if a is not first]
    everywhere = seen_while_held(
        origin, lambda: all(pool.has(s) for pool in pools for s in others))
    joined(threads)
    assert everywhere, "objects that landed waited behind the held one"
    succeeded(outcomes)
    assert all(pool.has(a.sha256) for pool in pools for a in arts)


def test_a_download_longer_than_the_timeout_keeps_the_move_waiting_in_step(
    tmp_path: Path,
) -> None:
    # 2.5 s of steady progress against a 1 s timeout: the fetch may take it (bytes keep
    # arriving), and so must the move beside it, whose receivers would give up on a
    # broadcast after 1 s if the source sent nothing while it waited.
    arts, blobs = make(4)
    origin = ScriptedOrigin(blobs, slow=frozenset({arts[0].name}))
    pools = [ArtifactPool(tmp_path / f"pool{r}") for r in range(2)]
    outcomes, threads = start_two(arts, pools, origin, 1.0)
    joined(threads)
    succeeded(outcomes)
    assert origin.calls == len(arts)
    assert all(pool.has(a.sha256) for pool in pools for a in arts)
    # The waiting source sent empty buckets: more broadcasts than a bucket per source.
    assert outcomes[0].broadcasts > 2


@pytest.mark.parametrize("held", [False, True])
def test_a_failed_download_ends_the_move_and_fails_every_rank_alike(
    tmp_path: Path, held: bool,
) -> None:
    arts, blobs = make(8)
    # Held: the failure comes while other downloads are still waiting to be answered.
    origin = ScriptedOrigin(blobs, free=3 if held else None,
                            missing=frozenset({arts[5].name}))
    pools = [ArtifactPool(tmp_path / f"pool{r}") for r in range(2)]
    outcomes, threads = start_two(arts, pools, origin, 20)
    if held:
        time.sleep(0.5)
        origin.release.set()
    joined(threads)
    assert all(isinstance(o, PrefetchError) for o in outcomes), outcomes
    assert str(outcomes[0]) == str(outcomes[1])
    assert outcomes[0].phase == "fetch" and outcomes[0].artifact == arts[5].name
    # The move beside the fetch ended too: no thread of it is left.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            t.name == "distcache-move" for t in threading.enumerate()):
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name == "distcache-move"]
    # What was answered is whole in the pool that downloaded it.
    for a in arts:
        if a.name != arts[5].name:
            held_by = [pool.get(a.sha256) for pool in pools if pool.has(a.sha256)]
            assert all(data == blobs[a.sha256] for data in held_by)


def test_a_pause_seals_the_bucket_built_so_far_even_an_empty_one() -> None:
    stats = StreamStats()
    items = [(0, b"a" * 10), (PAUSE, None), (PAUSE, None), (1, b"b" * 5), (2, None)]
    messages = list(bucket_messages(iter(items), bucket_bytes=1000, stats=stats))
    decoded = [decode_bucket(m, 3) for m in messages]
    assert [(last, [(i, None if v is None else bytes(v)) for i, v in entries])
            for last, entries in decoded] == [
        (False, [(0, b"a" * 10)]), (False, []), (True, [(1, b"b" * 5), (2, None)])]
    assert stats.broadcasts == 3
