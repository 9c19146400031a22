"""A move whose audiences overlap, a failure on one side of a writer that must not
spoil the other, what the node leaders' errors name, what a prefetch counts as
published, and how soon a stalled move is given up."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distcache._delegate import led_by_node_leaders
from distcache.collective import _audience, _heartbeat, prefetch
from distcache.collective._audience import Audience
from distcache.comm import Communicator, NodeTree, ThreadGroup
from distcache.errors import CollectiveTimeout, PrefetchError
from distcache.origins._directory import DirOrigin
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.unit.test_collective_move_edges import ForestalledPool
from tests.unit.test_prefetch import FakeOrigin, FakePool, Store, make_blobs, ok, run_ranks

pytestmark = pytest.mark.timeout(120)

#: A prefetch whose pools hold everything asks no origin.
NO_ORIGIN: Any = None


# -- audiences that overlap ----------------------------------------------------------


class SlowPool(FakePool):
    """A pool whose every put takes ``delay`` seconds, or waits for ``release``."""

    def __init__(self, store: Store, delay: float = 0.0,
                 release: threading.Event | None = None) -> None:
        super().__init__(store)
        self.delay, self.release = delay, release

    def put(self, data: bytes | bytearray | memoryview, sha256: str | None = None) -> str:
        if self.release is not None:
            self.release.wait(60)
        time.sleep(self.delay)
        return super().put(data, sha256)


def _overlapping(receiving: Callable[[Store], FakePool], *, timeout: float,
                 count: int = 10) -> tuple[list[Any], list[Store], dict[str, bytes]]:
    """Three pools: pool 0 holds every object, pool 1 lacks ``count`` of them and pool 2
    one other: two audiences that share rank 0, streamed one after the other. Each
    object travels in a bucket of its own; ``receiving`` makes pool 1. Each rank's
    result or error, the stores and the objects."""
    arts, blobs = make_blobs(count + 1, low=2000, high=3000)
    many, one = [a.sha256 for a in arts[:count]], arts[count].sha256
    stores = [Store(f"p{r}") for r in range(3)]
    stores[0].objects.update(blobs)
    stores[1].objects[one] = blobs[one]
    stores[2].objects.update({sha: blobs[sha] for sha in many})
    pools = [FakePool(stores[0]), receiving(stores[1]), FakePool(stores[2])]
    group = ThreadGroup(3, ["a", "b", "c"], timeout=timeout)
    out = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                              origin=NO_ORIGIN, bucket_bytes=1000,
                                              timeout=timeout), join=60)
    return out, stores, blobs


def test_a_writer_waiting_for_its_audience_waits_while_an_earlier_one_makes_progress(
) -> None:
    # Pool 1 publishes one object every 0.4 s: its audience streams for about twice
    # the timeout, and rank 2's audience (with rank 0) waits for it all that time.
    out, stores, blobs = _overlapping(lambda store: SlowPool(store, delay=0.4),
                                        timeout=2.0)
    reports = ok(out)
    assert all(set(store.objects) == set(blobs) for store in stores)
    assert {r.objects_published for r in reports} == {11}
    assert {r.broadcasts for r in reports} == {11}


def test_a_stalled_earlier_audience_still_fails_every_rank_alike() -> None:
    release = threading.Event()
    try:
        out, stores, _ = _overlapping(lambda store: SlowPool(store, release=release),
                                      timeout=1.0)
    finally:
        release.set()
    assert all(isinstance(exc, PrefetchError) for exc in out)
    assert len({str(exc) for exc in out}) == 1
    assert out[0].phase == "move" and "made no progress" in str(out[0])
    assert len(stores[2].objects) == 10  # its audience never streamed


def _audiences() -> list[Audience]:
    # Rank 0 streams to rank 1 first, then to rank 2.
    return [Audience((0, 1), ((0, (0, 1, 2)),)), Audience((0, 2), ((0, (3,)),))]


def test_turns_hold_back_only_the_writer_whose_fellow_member_is_busy_elsewhere() -> None:
    Turns = _audience.Turns
    first, waiting = Turns(0, _audiences()), Turns(2, _audiences())
    first.enter(0, 1.0)
    first.enter(1, 1.0)  # rank 2 is in no earlier audience: no wait
    entered = threading.Event()
    waits: list[int] = []

    def enter() -> None:
        waiting.enter(1, 1.0, lambda: waits.append(1))
        entered.set()

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    # The beats: rank 1 (no member of audience 1) and rank 2 are ready for it, rank 0
    # is still in audience 0.
    busy = Turns(0, _audiences())
    busy.enter(0, 1.0)
    waiting.heard(busy.ready() & Turns(1, _audiences()).ready() & waiting.ready())
    assert not entered.wait(0.5) and waits  # waited in slices, noting each
    waiting.heard(first.ready() & waiting.ready())
    assert entered.wait(30)
    thread.join(30)


def test_a_wait_for_a_turn_ends_when_the_heartbeats_give_up() -> None:
    Turns = _audience.Turns
    waiting = Turns(2, _audiences())
    failed: list[BaseException] = []

    def enter() -> None:
        try:
            waiting.enter(1, 1.0)
        except CollectiveTimeout as exc:
            failed.append(exc)

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    waiting.abandon()
    thread.join(30)
    assert not thread.is_alive() and len(failed) == 1
    Turns(2, _audiences(), waits=False).enter(1, 1.0)  # without heartbeats: never waits


# -- a writer that fails to read one object still publishes what it receives ---------


class HalfReadablePool(FakePool):
    """A pool that says it holds ``unreadable`` but cannot read it back (a corrupt
    object)."""

    def __init__(self, store: Store, unreadable: str) -> None:
        super().__init__(store)
        self.unreadable = unreadable

    def get(self, sha256: str, *, trust_own: bool = False) -> bytes | None:
        return None if sha256 == self.unreadable else super().get(sha256)


def test_a_source_that_cannot_read_one_object_still_publishes_what_it_receives() -> None:
    arts, blobs = make_blobs(4)
    shas = sorted(blobs)
    source, other = Store("a"), Store("b")
    source.objects.update({sha: blobs[sha] for sha in shas[:2]})
    other.objects.update({sha: blobs[sha] for sha in shas[2:]})
    pools = [HalfReadablePool(source, shas[0]), FakePool(other)]
    group = ThreadGroup(2, ["a", "b"], timeout=5)
    out = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                              origin=NO_ORIGIN, timeout=5))
    assert all(isinstance(exc, PrefetchError) for exc in out)
    name = next(a.name for a in arts if a.sha256 == shas[0])
    assert {exc.phase for exc in out} == {"move"} and {exc.artifact for exc in out} == {name}
    # Rank 0 read its own first object wrong before rank 1's bucket arrived: what that
    # bucket carried is in rank 0's pool all the same, and the good object in rank 1's.
    assert set(source.objects) == set(shas)
    assert set(other.objects) == set(shas[1:])


# -- the node leaders' errors name the job's ranks -----------------------------------


NODES = ["a", "a", "b", "b"]


def _led(tmp_path: Path, lead: Any, timeout: float) -> list[Any]:
    roots = {node: tmp_path / f"pool-{node}" for node in set(NODES)}
    for root in roots.values():
        ArtifactPool(root)
    group = ThreadGroup(4, NODES, timeout=timeout)

    def body(comm: Communicator) -> Any:
        tree = NodeTree(comm, timeout=timeout)
        pool = ArtifactPool(roots[comm.node_id])
        return led_by_node_leaders(tree, pool, "inputs", timeout=timeout,
                                   lead=lambda leaders: lead(leaders, pool))

    return [got for got in run_ranks(group, lambda r: body(group.comm(r)), join=60)]


def _leaders_error(leaders: Communicator, _pool: ArtifactPool) -> None:
    where = "rank 1/2 (b)"
    cause = f"OriginError: download stalled: {where} received no byte for 3.0 s"
    raise PrefetchError(f"prefetch failed in fetch on {where} for x: {cause}",
                        artifact="x", rank=1, host="b", cause=cause, phase="fetch")


def test_every_rank_a_leaders_error_names_is_the_jobs_in_its_text_and_cause(
        tmp_path: Path) -> None:
    out = _led(tmp_path, _leaders_error, timeout=5.0)
    for exc in out:
        assert isinstance(exc, PrefetchError)
        assert exc.rank == 2
        assert str(exc).count("rank 2/4 (b)") == 2 and "/2 (" not in str(exc)
        assert exc.cause == "OriginError: download stalled: rank 2/4 (b) received no byte for 3.0 s"


def test_a_stalled_download_under_node_leaders_names_one_rank_for_one_process(
        tmp_path: Path) -> None:
    arts = make_artifacts(tmp_path / "mirror", 4, min_size=2000, max_size=20000)
    release = threading.Event()

    class Hanging(DirOrigin):
        def fetch_into(self, artifact: Any, out: Any) -> int:
            if artifact.name == arts[0].name:
                release.wait(60)
            return super().fetch_into(artifact, out)

    origin = Hanging(tmp_path / "mirror")
    try:
        out = _led(tmp_path, lambda leaders, pool: prefetch(
            arts, comm=leaders, pool=pool, origin=origin, timeout=1.5), timeout=1.5)
    finally:
        release.set()
    assert all(isinstance(exc, PrefetchError) for exc in out)
    assert len({str(exc) for exc in out}) == 1
    text, cause = str(out[0]), out[0].cause
    named = {f"rank {r}/4" for r in range(4) if f"rank {r}/4" in text}
    assert len(named) == 1 and named <= {"rank 0/4", "rank 2/4"}
    assert "/2 (" not in text and "/2 (" not in cause and named.pop() in cause


# -- what a prefetch counts as published ---------------------------------------------


def test_a_download_skipped_because_the_object_arrived_meanwhile_counts_as_published(
) -> None:
    arts, blobs = make_blobs(4)
    pool = ForestalledPool(Store("nfs"), {arts[1].sha256: blobs[arts[1].sha256]})
    origin: Any = FakeOrigin(blobs)
    group = ThreadGroup(1, timeout=5)
    [report] = ok(run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pool,
                                                      origin=origin, timeout=5)))
    assert origin.total == 3 and report.downloads == 3
    assert set(pool.store.objects) == set(blobs)
    assert report.objects_published == 4


# -- a stalled move is given up once -------------------------------------------------


def test_a_stalled_move_is_not_waited_for_again_once_the_stall_is_known(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[tuple[float, bool]] = []
    join = _heartbeat.Worker.join

    def watched(self: _heartbeat.Worker, seconds: float) -> None:
        thread = self._thread
        waits.append((seconds, thread is not None and thread.is_alive()))
        join(self, seconds)

    monkeypatch.setattr(_heartbeat.Worker, "join", watched)
    arts, blobs = make_blobs(6, low=2000, high=3000)
    release = threading.Event()
    full, empty = Store("p0"), Store("p1")
    full.objects.update(blobs)
    pools = [FakePool(full), SlowPool(empty, release=release)]
    group = ThreadGroup(2, ["a", "b"], timeout=1.0)
    try:
        out = run_ranks(group, lambda r: prefetch(arts, comm=group.comm(r), pool=pools[r],
                                                  origin=NO_ORIGIN, bucket_bytes=1000,
                                                  timeout=1.0))
    finally:
        release.set()
    assert all(isinstance(exc, PrefetchError) for exc in out)
    assert all("made no progress" in str(exc) for exc in out)
    # The receiver's move was still stuck when the stall was agreed: not waited for.
    assert any(alive for _, alive in waits)
    assert all(seconds == 0 for seconds, alive in waits if alive)
