"""The pure planning of the collective: writers, downloaders, sources, buckets."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from distcache.collective._audience import Audience
from distcache.collective._bucket import decode_bucket, encode_bucket
from distcache.collective._plan import (
    decode_bitmap,
    elect_writers,
    encode_bitmap,
    make_plan,
    node_interleaved,
)
from distcache.errors import WireError

SHAS = [f"{i:064x}" for i in range(40)]


def nodes(n_ranks: int, per_node: int) -> list[str]:
    return [f"n{r // per_node}" for r in range(n_ranks)]


def test_bitmap_round_trips_and_is_compact() -> None:
    flags = [i % 3 == 0 for i in range(1001)]
    packed = encode_bitmap(flags)
    assert len(packed) == 126
    assert decode_bitmap(packed, 1001) == flags
    assert encode_bitmap([]) == b""


def test_bitmap_of_wrong_length_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        decode_bitmap(b"\x00\x00", 3)


def test_lowest_rank_of_each_pool_is_its_writer() -> None:
    assert elect_writers(["b", "a", "b", "a", "c"]) == {"b": 0, "a": 1, "c": 4}


def test_node_interleaving_visits_every_node_before_doubling_up() -> None:
    assert node_interleaved(["a", "a", "b", "b", "c"]) == [0, 2, 4, 1, 3]


def test_missing_everywhere_gets_exactly_one_downloader_spread_over_nodes() -> None:
    pool_ids = nodes(8, 2)  # node-local pools, 2 ranks per node
    have = {p: [False] * 8 for p in set(pool_ids)}
    plan = make_plan(SHAS[:8], [100] * 8, pool_ids, nodes(8, 2), have)
    assigned = sorted(i for v in plan.downloads.values() for i in v)
    assert assigned == list(range(8))
    assert sorted(plan.downloads) == list(range(8))  # one each: fully parallel
    first_four = [plan.downloader_of(i) for i in range(4)]
    assert {pool_ids[r] for r in first_four if r is not None} == {"n0", "n1", "n2", "n3"}


def test_downloads_balance_bytes_largest_first() -> None:
    sizes = [1000, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    pool_ids = ["p0", "p1"]
    have = {"p0": [False] * 10, "p1": [False] * 10}
    plan = make_plan(SHAS[:10], sizes, pool_ids, ["a", "b"], have)
    assert plan.downloads[0] == (0,)  # the big one alone
    assert len(plan.downloads[1]) == 9


def test_downloaded_objects_are_sent_by_the_writer_of_the_downloaders_pool() -> None:
    pool_ids = nodes(4, 2)
    have = {"n0": [False] * 4, "n1": [False] * 4}
    plan = make_plan(SHAS[:4], [None] * 4, pool_ids, pool_ids, have)
    for source, indices in plan.sends:
        assert source in plan.writer_ranks
        for i in indices:
            downloader = plan.downloader_of(i)
            assert downloader is not None
            assert plan.writers[pool_ids[downloader]] == source


def test_objects_some_pool_has_are_sent_by_a_holder_and_never_downloaded() -> None:
    pool_ids = ["p0", "p1", "p2"]
    have = {
        "p0": [True, True, False],
        "p1": [False, True, False],
        "p2": [True, True, False],
    }
    plan = make_plan(SHAS[:3], [5, 5, 5], pool_ids, ["a", "b", "c"], have)
    assert plan.hits == 1
    assert plan.download_count == 1 and plan.downloader_of(2) is not None
    sources = {i: s for s, idx in plan.sends for i in idx}
    assert sources[0] in (0, 2)
    assert 1 not in sources  # everyone has it
    assert plan.lacking[0] == frozenset({"p1"})
    assert plan.publications() == 1 + 3


def test_nothing_to_do_when_every_pool_has_everything() -> None:
    pool_ids = nodes(8, 2)
    have = {p: [True] * 5 for p in set(pool_ids)}
    plan = make_plan(SHAS[:5], [None] * 5, pool_ids, pool_ids, have)
    assert plan.downloads == {} and plan.sends == () and plan.hits == 5
    assert plan.publications() == 0


def test_single_shared_pool_spreads_downloads_and_moves_nothing() -> None:
    pool_ids = ["shared"] * 8
    have = {"shared": [False] * 16}
    plan = make_plan(SHAS[:16], [None] * 16, pool_ids, nodes(8, 2), have)
    assert sorted(plan.downloads) == list(range(8))
    assert plan.sends == ()
    assert plan.writer_ranks == (0,)


def test_sync_plan_reports_lost_objects_instead_of_downloading() -> None:
    have = {"p0": [True, False], "p1": [False, False]}
    plan = make_plan(SHAS[:2], [None, None], ["p0", "p1"], ["a", "b"], have, allow_downloads=False)
    assert plan.downloads == {} and plan.lost == (1,)
    assert plan.sends == ((0, (0,)),)
    assert plan.publications() == 1


def test_plan_rejects_a_pool_without_a_have_set() -> None:
    with pytest.raises(ValueError, match="have-set"):
        make_plan(SHAS[:1], [None], ["p0", "p1"], ["a", "b"], {"p0": [True]})


def test_cold_start_is_one_audience_of_every_writer() -> None:
    pool_ids = nodes(8, 2)
    have = {p: [False] * 12 for p in set(pool_ids)}
    plan = make_plan(SHAS[:12], [100] * 12, pool_ids, pool_ids, have)
    assert [a.ranks for a in plan.audiences] == [(0, 2, 4, 6)]
    assert sum(a.objects for a in plan.audiences) == 12


def test_replaced_node_gets_its_objects_from_one_warm_writer_alone() -> None:
    pool_ids = nodes(10, 2)  # five node pools; node n4 was replaced and is empty
    have = {p: [p != "n4"] * 6 for p in set(pool_ids)}
    plan = make_plan(SHAS[:6], [10, 20, 30, 40, 50, 60], pool_ids, pool_ids, have)
    assert plan.downloads == {}
    assert plan.audiences == (Audience((0, 8), ((0, (0, 1, 2, 3, 4, 5)),)),)
    assert plan.publications() == 6


def test_objects_with_the_same_lack_set_share_a_source_and_distinct_sets_spread() -> None:
    pool_ids = ["p0", "p1", "p2", "p3"]
    # Objects 0-3 are lacked by p2 only, objects 4-7 by p3 only.
    have = {
        "p0": [True] * 8,
        "p1": [True] * 8,
        "p2": [False] * 4 + [True] * 4,
        "p3": [True] * 4 + [False] * 4,
    }
    plan = make_plan(SHAS[:8], [5] * 8, pool_ids, ["a", "b", "c", "d"], have)
    assert plan.audiences == (
        Audience((0, 2), ((0, (0, 1, 2, 3)),)),
        Audience((1, 3), ((1, (4, 5, 6, 7)),)),
    ), "two disjoint audiences, one source each: they can stream side by side"


def test_downloads_and_partial_objects_keep_separate_audiences() -> None:
    pool_ids = ["p0", "p1", "p2"]
    have = {"p0": [False, True], "p1": [False, True], "p2": [False, False]}
    plan = make_plan(SHAS[:2], [5, 5], pool_ids, ["a", "b", "c"], have)
    assert plan.download_count == 1
    everyone, smaller = plan.audiences
    assert everyone.ranks == (0, 1, 2) and [i for _, idx in everyone.sends for i in idx] == [0]
    # Rank 0 already sends the download, so the other holder sends the partial object.
    assert plan.downloads == {0: (0,)}
    assert smaller == Audience((1, 2), ((1, (1,)),))


def test_audiences_beyond_the_cap_fall_back_to_every_writer() -> None:
    pool_ids = [f"p{r}" for r in range(6)]
    # Object k is lacked by pool k alone: six distinct audiences of two writers.
    have = {p: [k != r for k in range(6)] for r, p in enumerate(pool_ids)}
    sizes = [100, 600, 200, 500, 300, 400]
    plan = make_plan(SHAS[:6], sizes, pool_ids, list("abcdef"), have, max_audiences=2)
    everyone, *smaller = plan.audiences
    assert everyone.ranks == tuple(range(6))
    assert len(smaller) == 2
    kept = sorted(i for a in smaller for _, idx in a.sends for i in idx)
    assert kept == [1, 3], "the biggest savings keep their own audience"
    assert sorted(i for _, idx in everyone.sends for i in idx) == [0, 2, 4, 5]
    uncapped = make_plan(SHAS[:6], sizes, pool_ids, list("abcdef"), have)
    assert len(uncapped.audiences) == 6 and all(len(a.ranks) == 2 for a in uncapped.audiences)


@settings(max_examples=150, deadline=None)
@given(
    n_ranks=st.integers(1, 9),
    n_pools=st.integers(1, 9),
    n_objects=st.integers(0, 25),
    max_audiences=st.integers(0, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_plan_fills_every_pool_with_one_download_per_missing_object(
    n_ranks: int, n_pools: int, n_objects: int, max_audiences: int, seed: int
) -> None:
    import random

    rng = random.Random(seed)
    pool_ids = [f"p{rng.randrange(n_pools)}" for _ in range(n_ranks)]
    node_ids = [f"n{rng.randrange(3)}" for _ in range(n_ranks)]
    have = {p: [rng.random() < 0.6 for _ in range(n_objects)] for p in set(pool_ids)}
    sizes = [rng.choice([None, rng.randrange(1, 10**6)]) for _ in range(n_objects)]
    plan = make_plan(SHAS[:n_objects], sizes, pool_ids, node_ids, have, max_audiences=max_audiences)

    # Simulate: downloads land in the downloader's pool, then each send reaches the
    # pools of its audience only.
    state = {p: list(flags) for p, flags in have.items()}
    downloaded = [i for v in plan.downloads.values() for i in v]
    assert len(downloaded) == len(set(downloaded))
    assert set(downloaded) == {i for i in range(n_objects) if not any(h[i] for h in have.values())}
    for rank, indices in plan.downloads.items():
        for i in indices:
            state[pool_ids[rank]][i] = True
    pool_of = {w: p for p, w in plan.writers.items()}
    smaller = [a for a in plan.audiences if a.ranks != plan.writer_ranks]
    assert len(smaller) <= max_audiences
    sent = [i for _, indices in plan.sends for i in indices]
    assert len(sent) == len(set(sent)), "each object is sent once"
    for audience in plan.audiences:
        assert audience.ranks == tuple(sorted(audience.ranks))
        for source, indices in audience.sends:
            assert plan.writers[pool_ids[source]] == source and source in audience.ranks
            for i in indices:
                assert state[pool_ids[source]][i], "a source sends only what its pool holds"
                lacking = {plan.writers[p] for p in plan.lacking[i]} - {source}
                assert lacking <= set(audience.ranks), "every pool that lacks it hears it"
                if audience in smaller:
                    assert set(audience.ranks) == lacking | {source}, "and no other"
                for w in audience.ranks:
                    state[pool_of[w]][i] = True
    assert all(all(flags) for flags in state.values())
    assert plan.lost == ()


def test_bucket_round_trips_with_missing_entries() -> None:
    message = encode_bucket([(3, b"abc"), (7, None), (9, b""), (11, b"x" * 1000)], last=True)
    last, entries = decode_bucket(bytes(message))
    assert last is True
    assert [(i, None if v is None else bytes(v)) for i, v in entries] == [
        (3, b"abc"),
        (7, None),
        (9, b""),
        (11, b"x" * 1000),
    ]


def test_corrupt_bucket_is_rejected() -> None:
    message = bytes(encode_bucket([(1, b"abc")], last=False))
    with pytest.raises(ValueError):
        decode_bucket(message[1:])
    with pytest.raises(ValueError):
        decode_bucket(b"xx")


def test_a_malformed_bucket_or_one_naming_an_object_beyond_the_plan_is_a_wire_error() -> None:
    message = bytes(encode_bucket([(1, b"abc"), (7, b"de")], last=True))
    assert [i for i, _ in decode_bucket(message, 8)[1]] == [1, 7]
    with pytest.raises(WireError, match="names object 7 of 5"):
        decode_bucket(message, 5)
    for broken in (message[1:], b"xx", message[:-1] + b"\xff"):
        with pytest.raises(WireError):
            decode_bucket(broken)
