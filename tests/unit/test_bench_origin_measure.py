"""The benchmark's measurement of its origin: latency and bandwidth from interleaved
requests, sampled again where one round's medians cannot tell the sizes apart."""

from __future__ import annotations

from typing import Any

import pytest

from distcache.artifact import Artifact
from scripts import bench_prefetch as bench

SMALL = Artifact("small.cubin", "a" * 64, size=1_000)
BIG = Artifact("big.cubin", "b" * 64, size=1_001_000)


class _Clocked:
    """An origin whose requests take the seconds ``took(name, n)`` says on a fake
    clock (``n``: that artifact's requests so far)."""

    def __init__(self, took: Any) -> None:
        self.now = 0.0
        self.took = took
        self.asked = {SMALL.name: 0, BIG.name: 0}

    def fetch(self, artifact: Artifact) -> bytes:
        self.now += self.took(artifact.name, self.asked[artifact.name])
        self.asked[artifact.name] += 1
        return b""


def _measure(monkeypatch: pytest.MonkeyPatch, origin: _Clocked) -> dict[str, float]:
    monkeypatch.setattr(bench.time, "perf_counter", lambda: origin.now)
    return bench.measure_origin(origin, [SMALL, BIG])  # type: ignore[arg-type]


def test_latency_and_bandwidth_from_the_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    origin = _Clocked(lambda name, n: 0.1 + (0.01 if name == BIG.name else 0.0))
    got = _measure(monkeypatch, origin)
    assert got["request_latency_s"] == pytest.approx(0.1)
    assert got["origin_bandwidth_Bps"] == pytest.approx(1_000_000 / 0.01)
    assert origin.asked == {SMALL.name: 7, BIG.name: 7}


def test_a_round_whose_medians_do_not_differ_is_sampled_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Four of the small artifact's first seven requests are slowed by jitter: the first
    # round's medians cannot tell the sizes apart, the first two rounds' can.
    def took(name: str, n: int) -> float:
        if name == SMALL.name:
            return 0.11 if n < 4 else 0.1
        return 0.105

    origin = _Clocked(took)
    got = _measure(monkeypatch, origin)
    assert origin.asked == {SMALL.name: 14, BIG.name: 14}
    assert got["origin_bandwidth_Bps"] > 0


def test_sizes_that_never_differ_in_time_end_the_benchmark_saying_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    origin = _Clocked(lambda name, n: 0.1)
    with pytest.raises(SystemExit, match="over 28 interleaved requests"):
        _measure(monkeypatch, origin)
    assert origin.asked == {SMALL.name: 28, BIG.name: 28}
