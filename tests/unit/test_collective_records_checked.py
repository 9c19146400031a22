"""What a rank receives from the others in a collective's rounds is checked for its
shape before it is used: a failure record, a pool offer or a probe report of another
shape (another build of distcache, a hostile rank) is a WireError naming the sender on
every rank, not a raw TypeError, KeyError or ValueError."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from distcache.collective._run import Run
from distcache.collective._sharing import agree_pools
from distcache.errors import PrefetchError, WireError

GOOD_FAILURE = ("fetch", "k.cubin", 0, "host0", "OriginError: refused")


class ScriptedComm:
    """Rank ``rank`` of ``size``, whose all-gathers answer from ``script`` in turn."""

    backend = "fake"
    node_id = "node"

    def __init__(self, rank: int, size: int, script: list[list[Any]]) -> None:
        self.rank, self.size, self._script = rank, size, script

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return self._script.pop(0)


class SeeingIdentity:
    def probe(self, name: str, token: str) -> contextlib.AbstractContextManager[bool]:
        @contextlib.contextmanager
        def placed() -> Iterator[bool]:
            yield True
        return placed()

    def sees(self, name: str, token: str) -> bool:
        return True


class OnePool:
    identity = SeeingIdentity()


def _run(rank: int, size: int, script: list[list[Any]]) -> Run:
    return Run("prefetch", ScriptedComm(rank, size, script), OnePool(), 10.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("sent", [
    ["fetch", "k", 1, "h", "E: x"],          # a list
    ("fetch", "k", 1, "h"),                   # four fields
    ("fetch", "k", True, "h", "E: x"),       # a bool for the rank
    ("fetch", 7, 1, "h", "E: x"),            # a number for the artifact
    "fetch failed",
])
def test_a_malformed_failure_record_is_a_wire_error_naming_its_sender(sent: Any) -> None:
    with pytest.raises(WireError) as caught:
        _run(0, 3, []).raise_first([None, sent, GOOD_FAILURE])
    assert caught.value.peer == 1
    assert "rank 1 sent a malformed failure record" in str(caught.value)


def test_well_formed_failure_records_still_raise_the_agreed_prefetch_error() -> None:
    with pytest.raises(PrefetchError) as caught:
        _run(1, 2, []).raise_first([GOOD_FAILURE, None])
    assert (caught.value.artifact, caught.value.rank, caught.value.phase) == ("k.cubin", 0, "fetch")


@pytest.mark.parametrize("offer", [
    ["id", "name"],
    {"id": "p", "name": "n"},                                     # missing keys
    {"id": 5, "name": "n", "token": "t", "renewed": False},       # id not a str
    {"id": "p", "name": "n", "token": "t", "renewed": 1},         # renewed not a bool
])
def test_a_malformed_pool_offer_is_a_wire_error_naming_its_sender(offer: Any) -> None:
    run = _run(1, 2, [[(offer, None), (None, None)]])
    with pytest.raises(WireError) as caught:
        agree_pools(run, ["p" * 32, "p" * 32], ["a", "b"])
    assert caught.value.peer == 0 and "malformed offer" in str(caught.value)


@pytest.mark.parametrize("pair", [None, ("only one",), 3])
def test_a_gathered_entry_that_is_no_pair_is_a_wire_error(pair: Any) -> None:
    run = _run(1, 2, [[pair, (None, None)]])
    with pytest.raises(WireError) as caught:
        agree_pools(run, ["p" * 32, "p" * 32], ["a", "b"])
    assert caught.value.peer == 0


@pytest.mark.parametrize("report", [[0], ("0",), (5,), (True,)])
def test_a_malformed_probe_report_is_a_wire_error_naming_its_sender(report: Any) -> None:
    offer = {"id": "p" * 32, "name": "n" * 32, "token": "t" * 32, "renewed": False}
    run = _run(1, 2, [[(offer, None), (None, None)], [(0,), report]])
    with pytest.raises(WireError) as caught:
        agree_pools(run, ["p" * 32, "p" * 32], ["a", "b"])
    assert caught.value.peer == 1 and "malformed report" in str(caught.value)


def test_well_formed_rounds_still_agree_that_the_ranks_share_the_pool() -> None:
    offer = {"id": "p" * 32, "name": "n" * 32, "token": "t" * 32, "renewed": False}
    run = _run(1, 2, [[(offer, None), (None, None)], [(0,), (0,)]])
    assert agree_pools(run, ["p" * 32, "p" * 32], ["a", "b"]) == ["p" * 32, "p" * 32]


@pytest.mark.parametrize("state", [
    {"over": True, "late": None, "failure": None},                      # no "ready"
    {"over": 1, "late": None, "failure": None, "ready": -1},            # over not a bool
    {"over": False, "late": (1, 2.0), "failure": None, "ready": -1},   # a short late entry
    {"over": True, "late": None, "failure": ["fetch"], "ready": -1},    # a list failure
    {"over": True, "late": None, "failure": None, "ready": -1, "halt": 1},  # halt not a bool
    ("over", True),
])
def test_a_malformed_heartbeat_state_is_a_wire_error(state: Any) -> None:
    from distcache.collective._heartbeat import _combine

    good = {"over": True, "late": None, "failure": None, "ready": -1, "halt": False}
    with pytest.raises(WireError, match="malformed heartbeat"):
        _combine([good, state])
    assert _combine([good, dict(good, failure=GOOD_FAILURE)])["failure"] == GOOD_FAILURE


@pytest.mark.parametrize("entry", [None, (b"", None), [b"", None, "n"], 5])
def test_a_malformed_have_set_record_fails_the_prefetch_naming_its_sender(entry: Any) -> None:
    from distcache.collective._run import discover

    run = _run(0, 2, [[(None, None, "a"), entry]])
    with pytest.raises(PrefetchError) as caught:
        discover(run, ["ab" * 32], ["p" * 32, "q" * 32])
    assert caught.value.rank == 1 and "malformed have-set" in str(caught.value)


def test_a_malformed_payload_is_an_agreed_error_where_every_rank_received_it() -> None:
    """Agreed: the prefetch words it the same on every rank, and one rank reports it."""
    from distcache.collective import _heartbeat, _sharing, _sync, _totals
    from distcache.ipc import _probe

    raising = [
        lambda: _heartbeat.sent_failures([["x"]], "prefetch"),
        lambda: _heartbeat._checked_state({"over": 1}),
        lambda: _sync._infos([("p",)]),
        lambda: _totals._check(0, {"downloads": True}),
        lambda: _probe._checked([("n", 1, "x")], (str, bool, str), "vote"),
    ]
    for call in raising:
        with pytest.raises(WireError) as caught:
            call()
        assert caught.value.agreed is True, call
    assert _sharing._malformed(1, "offer", None).agreed is True
