"""More of what a rank receives from the others is checked for its shape before it is
used: the ranks an audience's members all-gather before a move, rank 0's address for
the NCCL group's store, each rank's (pool id, node id) at a sync, each rank's figures
in the closing totals, the CUDA IPC votes and trial exports, and the packed pool
descriptors. A malformed one is a typed error naming the sender, not a raw
TypeError, KeyError or IndexError, a hang or a silent misuse."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest

from distcache.collective import prefetch, sync
from distcache.collective._audience import Audience
from distcache.collective._bucket import StreamStats, encode_bucket
from distcache.collective._plan import Plan
from distcache.collective._report import PHASES
from distcache.collective._stream import NO_OBJECT, move_objects
from distcache.collective._totals import combine
from distcache.comm import Communicator, ThreadGroup
from distcache.comm._base import Forwarding
from distcache.comm._bulk import shared_store
from distcache.errors import CommError, IpcError, PrefetchError, WireError
from distcache.ipc import _probe
from distcache.ipc._descriptor import PoolDescriptor, gathered_descriptors
from distcache.ipc._probe import agree_backend
from distcache.store._pool import ArtifactPool
from tests.support.helpers import on_threads
from tests.unit.test_prefetch import FakePool, Store, make_blobs, make_pools, run_ranks

pytestmark = pytest.mark.timeout(120)


class ScriptedComm:
    """Rank ``rank`` of ``size``: its all-gathers answer from ``script`` in turn, and
    each broadcast it receives is ``bucket``."""

    backend = "fake"
    node_id = "n0"

    def __init__(self, rank: int, size: int, script: list[Any], bucket: bytes = b"") -> None:
        self.rank, self.size, self._script, self._bucket = rank, size, list(script), bucket
        self.roots: list[int] = []

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return self._script.pop(0)  # type: ignore[no-any-return]

    def broadcast_bytes(self, data: bytes | None, root: int, *,
                        timeout: float | None = None) -> bytes:
        self.roots.append(root)
        return data if data is not None else self._bucket

    def barrier(self, *, timeout: float | None = None) -> None:
        pass

    def split(self, color: int) -> ScriptedComm:
        return self


class Altering(Forwarding):
    """A rank's communicator, through every split: ``alter(sent, gathered, child)``
    may change what each of its all-gathers returns (a faulty or hostile peer's
    answer could differ)."""

    def __init__(self, inner: Communicator, alter: Any, *, child: bool = False) -> None:
        self._base, self.alter, self.child = inner, alter, child

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return self.alter(obj, self._base.allgather_object(obj, timeout=timeout),  # type: ignore[no-any-return]
                          self.child)

    def split(self, color: int) -> Altering:
        return Altering(self._base.split(color), self.alter, child=True)


# -- the ranks of an audience, before a move --------------------------------------------

DATA = b"the bytes of one object" * 8
SHA = hashlib.sha256(DATA).hexdigest()
PLAN = Plan(objects=(SHA,), pools=("p0", "p1"), writers={"p0": 0, "p1": 1},
            lacking=(frozenset({"p1"}),), downloads={},
            audiences=(Audience((0, 1), ((0, (0,)),)),), lost=())


def _move(world_of: Any) -> tuple[Any, ScriptedComm, Store]:
    store = Store("p1")
    comm = ScriptedComm(1, 2, [world_of], bytes(encode_bucket([(0, DATA)], last=True)))
    got = move_objects(comm, 1, PLAN, FakePool(store), pool_ids=["p0", "p1"],  # type: ignore[arg-type]
                       bucket_bytes=1 << 20, stats=StreamStats(), timeout=5.0)
    return got, comm, store


@pytest.mark.parametrize(("world_of", "peer"), [
    ([1, 1], 1),        # a rank claimed twice (and rank 0 missing)
    ([0, 0], 1),        # the source claimed twice: a broadcast from the wrong root
    (["0", 1], 0),      # not an int
    ([True, 1], 0),     # a bool
    ([0, 5], 1),        # a rank outside the audience
    ([0], None),        # too few
    ([0, 1, 2], None),  # too many
    (None, None),
])
def test_an_audience_whose_ranks_are_not_its_members_fails_the_move_naming_the_sender(
        world_of: Any, peer: int | None) -> None:
    got, comm, store = _move(world_of)
    assert got is not None and got[0] == NO_OBJECT
    assert isinstance(got[1], WireError) and got[1].peer == peer, got
    assert comm.roots == [] and SHA not in store.objects  # skipped: no broadcast at all


@pytest.mark.parametrize(("world_of", "root"), [([0, 1], 0), ([1, 0], 1)])
def test_an_audience_whose_ranks_are_its_members_moves_from_the_right_root(
        world_of: list[int], root: int) -> None:
    got, comm, store = _move(world_of)
    assert got is None and comm.roots == [root] and store.objects[SHA] == DATA


def test_a_move_whose_audience_ranks_are_malformed_fails_promptly_on_every_rank() -> None:
    arts, blobs = make_blobs(3)
    pools, stores = make_pools(2, lambda r: f"rank{r}")
    stores["rank0"].objects.update(blobs)
    timeout = 10.0
    group = ThreadGroup(2, timeout=timeout)

    def claim_rank_0_twice(sent: Any, gathered: list[Any], child: bool) -> list[Any]:
        # The move's communicator is a split; its first round is each member's rank.
        return [0, 0] if child and type(sent) is int else gathered

    comms = [Altering(group.comm(r), claim_rank_0_twice) for r in range(2)]
    start = time.monotonic()
    results = run_ranks(group, lambda r: prefetch(arts, comm=comms[r], pool=pools[r],
                                                  origin=None, timeout=timeout))
    assert time.monotonic() - start < timeout / 2
    for result in results:
        assert isinstance(result, PrefetchError), results
        assert "WireError" in str(result.cause) and "member 1" in str(result.cause)


# -- rank 0's address for the NCCL group's store ---------------------------------------


def _stores(answer: Any) -> list[Any]:
    group = ThreadGroup(2, timeout=5.0)
    rounds = [0]

    def address_of_rank_0(sent: Any, gathered: list[Any], child: bool) -> list[Any]:
        rounds[0] += 1
        return [answer, *gathered[1:]] if rounds[0] == 2 else gathered

    comms: list[Any] = [group.comm(0), Altering(group.comm(1), address_of_rank_0)]
    return on_threads(2, lambda r: shared_store(comms[r], 5.0), join=60)


@pytest.mark.parametrize("answer", [
    ("ok", 5, 1234), ("ok", "127.0.0.1", "1234"), ("ok", "127.0.0.1", True),
    ("ok", "127.0.0.1", 70000), ("ok", "", 1234), ("ok", "127.0.0.1"),
    ["ok", "127.0.0.1", 1234], None,
])
def test_a_malformed_store_address_is_a_comm_error_on_every_rank(answer: Any) -> None:
    results = _stores(answer)
    assert all(type(r) is CommError for r in results), results
    assert all("rank 0 sent a malformed address" in str(r) for r in results), results


def test_a_well_formed_store_address_gives_every_rank_the_store() -> None:
    group = ThreadGroup(2, timeout=5.0)
    results = on_threads(2, lambda r: shared_store(group.comm(r), 5.0), join=60)
    assert not any(isinstance(r, BaseException) for r in results), results
    results[1].set("key", "value")
    assert results[0].get("key") == b"value"  # one store, reached by both ranks


# -- each rank's (pool id, node id) at a sync ------------------------------------------


@pytest.mark.parametrize("info", [None, ("p",), (5, "n1"), ("p" * 32, 7), "pn", ["p", "n"]])
def test_a_malformed_sync_info_is_a_wire_error_naming_its_sender(
        tmp_path: Path, info: Any) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    group = ThreadGroup(2, timeout=20)

    def rank_1_sent(sent: Any, gathered: list[Any], child: bool) -> list[Any]:
        ids = {pool.pool_id for pool in pools}
        first = type(sent) is tuple and len(sent) == 2 and sent[0] in ids
        return [gathered[0], info] if first else gathered

    comms = [Altering(group.comm(r), rank_1_sent) for r in range(2)]
    results = on_threads(2, lambda r: sync(comm=comms[r], pool=pools[r]))
    for result in results:
        assert isinstance(result, PrefetchError), results
        assert isinstance(result.__cause__, WireError) and result.__cause__.peer == 1


def test_a_well_formed_sync_still_succeeds(tmp_path: Path) -> None:
    pools = [ArtifactPool(tmp_path / f"rank{r}") for r in range(2)]
    pools[0].put(DATA)
    group = ThreadGroup(2, timeout=20)
    results = on_threads(2, lambda r: sync(comm=group.comm(r), pool=pools[r]))
    assert not any(isinstance(r, BaseException) for r in results), results
    assert pools[1].has(SHA)


# -- each rank's figures in the closing totals -----------------------------------------


def _figures(rank: int, **changes: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "downloads": 1, "origin_bytes": 10, "broadcasts": 2, "broadcast_bytes": 20,
        "received_bytes": 0, "discarded_bytes": 0, "published": 1, "peak": 5,
        "seconds": dict.fromkeys(PHASES, 0.5), "downloaders": [rank], "failure": None}
    entry.update(changes)
    return entry


@pytest.mark.parametrize("entry", [
    {k: v for k, v in _figures(1).items() if k != "peak"},     # a key missing
    _figures(1, extra=1),                                      # a key too many
    _figures(1, downloads="3"),
    _figures(1, downloads=True),
    _figures(1, seconds={}),
    _figures(1, seconds=dict.fromkeys(PHASES, "1")),
    _figures(1, downloaders="ab"),
    _figures(1, downloaders=5),
    _figures(1, downloaders=["x"]),
    _figures(1, failure="boom"),
    _figures(1, failure=("fetch",)),
    None,
])
def test_malformed_figures_are_a_wire_error_naming_their_rank(entry: Any) -> None:
    with pytest.raises(WireError) as caught:
        combine([_figures(0), entry, _figures(2)])
    assert caught.value.peer == 1 and "entry 1" in str(caught.value)


def test_well_formed_figures_still_combine() -> None:
    failure = ("fetch", "k.cubin", 2, "h", "OriginError: refused")
    total = combine([_figures(0), _figures(1, downloaders=[]), _figures(2, failure=failure)])
    assert total["downloads"] == 3 and total["peak"] == 5
    assert total["downloaders"] == [0, 2] and total["failure"] == failure


# -- the CUDA IPC votes and trial exports ----------------------------------------------


@pytest.mark.parametrize("vote", [
    None, ("n0", False), (7, True, ""), ("n0", True, 5), ["n1", False, ""],
    ("n1", "yes", ""),
])
def test_a_malformed_ipc_vote_is_a_wire_error_naming_its_sender(vote: Any) -> None:
    comm = ScriptedComm(0, 2, [[("n0", False, ""), vote]])
    with pytest.raises(WireError) as caught:
        agree_backend(comm, False, None, 5.0)  # type: ignore[arg-type]
    assert caught.value.peer == 1 and "malformed vote" in str(caught.value)


@pytest.mark.parametrize("trial", [None, ("", b"u"), ("", "uuid", b"h"), (None, b"", b"")])
def test_a_malformed_trial_export_is_a_wire_error_naming_its_sender(
        monkeypatch: pytest.MonkeyPatch, trial: Any) -> None:
    monkeypatch.setattr(_probe, "probe_cuda_ipc", lambda device: (True, ""))
    votes = [("n0", False, ""), ("n0", True, "")]
    comm = ScriptedComm(0, 2, [votes, ["", None], [("", b"", b""), trial], ["", ""]])
    with pytest.raises(WireError) as caught:
        agree_backend(comm, False, None, 5.0)  # type: ignore[arg-type]
    assert caught.value.peer == 1 and "malformed trial export" in str(caught.value)


def test_well_formed_ipc_votes_still_agree() -> None:
    comm = ScriptedComm(0, 2, [[("n0", False, ""), ("n1", False, "")]])
    assert agree_backend(comm, False, None, 5.0) == ("shm", ["n0", "n1"])  # type: ignore[arg-type]


# -- the packed pool descriptors -------------------------------------------------------


def _packed(owner: int) -> bytes:
    return PoolDescriptor(
        pool_id=f"pool-{owner}", backend="shm", owner=owner, node_id="node0", epoch=1,
        capacity=1 << 20, data_start=1024, slots=16, ack_words=3, device=-1,
        consumers=(0, 1), handle=b"distcache.pool").pack()


@pytest.mark.parametrize("packed", [5, None, b"abc", (b"x",), [5], ["x"], [b"garbage"]])
def test_malformed_packed_descriptors_are_an_ipc_error_naming_the_rank(packed: Any) -> None:
    with pytest.raises(IpcError, match="rank 1 sent"):
        gathered_descriptors([[_packed(0)], packed])


def test_well_formed_packed_descriptors_still_decode() -> None:
    got = gathered_descriptors([[_packed(0)], [_packed(1)]])
    assert [d.pool_id for d in got] == ["pool-0", "pool-1"]
