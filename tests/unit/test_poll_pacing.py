"""How often a wait polls: its first and longest pauses follow how many processes
share each core, so ranks that outnumber the cores wake less often while they wait
(each wake is CPU the working ranks need), and ranks with a core each poll as
tightly as before."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from distcache.comm import _base


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in _base._LOCAL_PROCESSES:
        monkeypatch.delenv(name, raising=False)
    _base._processes_per_core.cache_clear()
    yield monkeypatch
    _base._processes_per_core.cache_clear()


def _sleeps(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[float]:
    """The pauses of a wait of ``seconds`` that never completes, on a clock that only
    its sleeps move."""
    now, slept = [0.0], []
    monkeypatch.setattr(_base.time, "monotonic", lambda: now[0])

    def sleep(pause: float) -> None:
        slept.append(pause)
        now[0] += pause

    monkeypatch.setattr(_base.time, "sleep", sleep)
    assert _base.poll_until(lambda: False, seconds) is False
    return slept


@pytest.mark.parametrize(("processes", "cores", "first", "longest"), [
    ("64", 2, 640e-6, 50e-3),      # 32 a core: the first pause 32 times the tightest
    ("200", 2, 2e-3, 50e-3),       # capped at the short sleep
    ("4", 8, 20e-6, 5e-3),         # a core each: as tight as ever
])
def test_the_pauses_follow_the_processes_per_core(host: pytest.MonkeyPatch, processes: str,
                                                  cores: int, first: float,
                                                  longest: float) -> None:
    host.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", processes)
    host.setattr(_base, "usable_cpus", lambda: cores)
    assert _base._shortest_pause() == pytest.approx(first)
    assert _base._longest_pause() == pytest.approx(longest)


@pytest.mark.parametrize(("processes", "first", "tight"), [("2", 20e-6, 7), ("64", 640e-6, 2)])
def test_a_wait_starts_at_its_shortest_pause(host: pytest.MonkeyPatch, processes: str,
                                            first: float, tight: int) -> None:
    host.setattr(_base, "usable_cpus", lambda: 2)
    host.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", processes)
    slept = _sleeps(host, 1.0)
    assert slept[0] == pytest.approx(first)
    # Doubling up to the 2 ms short sleep: 7 pauses from 20 us, 2 from 640 us.
    assert sum(1 for pause in slept[:-1] if pause < _base._POLL_MAX_S) == tight  # not the cut last
    assert max(slept) <= _base._longest_pause()
