"""Rank 0's bar tells the truth when some sizes are unknown (a ``checksums.txt``
lists none): it counts bytes without a total rather than passing 100 %."""

from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.collective import _progress, prefetch
from distcache.comm import LocalCommunicator
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool


class Bar:
    """What a tqdm bar was told."""

    made: list[Bar] = []

    def __init__(self, *, total: int | None, **_: Any) -> None:
        self.total, self.n = total, 0
        Bar.made.append(self)

    def update(self, n: int) -> None:
        self.n += n

    def close(self) -> None:
        pass


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[Bar]:
    Bar.made = []
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    monkeypatch.setattr(_progress, "_terminal", lambda: True)
    return Bar.made


def _mirror(tmp_path: Path, sized: list[bool]) -> list[Artifact]:
    arts = []
    for i, known in enumerate(sized):
        data = f"kernel {i}".encode() * 1000
        path = tmp_path / "mirror" / f"k{i}.cubin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        arts.append(Artifact(f"k{i}.cubin", hashlib.sha256(data).hexdigest(),
                             len(data) if known else None))
    return arts


def test_a_bar_never_counts_past_its_total_when_some_sizes_are_unknown(
        tmp_path: Path, bars: list[Bar]) -> None:
    arts = _mirror(tmp_path, [True, False, False])
    prefetch(arts, comm=LocalCommunicator(), pool=ArtifactPool(tmp_path / "pool"),
             origin=DirOrigin(tmp_path / "mirror"))
    (bar,) = bars
    assert bar.n == sum(len(f"kernel {i}".encode() * 1000) for i in range(3))
    assert bar.total is None or bar.n <= bar.total, (bar.n, bar.total)


def test_a_bar_counts_bytes_when_no_size_is_known(tmp_path: Path, bars: list[Bar]) -> None:
    arts = _mirror(tmp_path, [False, False])
    prefetch(arts, comm=LocalCommunicator(), pool=ArtifactPool(tmp_path / "pool"),
             origin=DirOrigin(tmp_path / "mirror"))
    assert [(bar.total, bar.n) for bar in bars] == [(None, 2 * 8000)]


def test_every_size_known_gives_a_bar_with_its_total(tmp_path: Path, bars: list[Bar]) -> None:
    arts = _mirror(tmp_path, [True, True])
    prefetch(arts, comm=LocalCommunicator(), pool=ArtifactPool(tmp_path / "pool"),
             origin=DirOrigin(tmp_path / "mirror"))
    assert [(bar.total, bar.n) for bar in bars] == [(16000, 16000)]


class LostTerminal(Bar):
    """A bar whose terminal went away after the first update (a hung-up ssh session:
    every write to stderr fails with EIO)."""

    def update(self, n: int) -> None:
        if self.n:
            raise OSError(5, "Input/output error")
        super().update(n)

    def close(self) -> None:
        raise OSError(5, "Input/output error")


def test_a_terminal_that_goes_away_drops_the_bar_not_the_prefetch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=LostTerminal))
    monkeypatch.setattr(_progress, "_terminal", lambda: True)
    arts = _mirror(tmp_path, [True, True, True])
    pool = ArtifactPool(tmp_path / "pool")
    report = prefetch(arts, comm=LocalCommunicator(), pool=pool,
                      origin=DirOrigin(tmp_path / "mirror"))
    assert report.downloads == 3
    assert all(pool.has(a.sha256) for a in arts)
    assert "progress bar dropped" in caplog.text
