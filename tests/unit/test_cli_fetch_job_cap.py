"""``distcache fetch`` keeps to the job's cap on concurrent downloads.

It took only DISTCACHE_DOWNLOADS_PER_RANK, so DISTCACHE_DOWNLOADS_PER_JOB, the
setting that keeps a rate-limiting origin (a CDN) within its limit, was ignored: with
it at 1, fetch still ran 4 downloads at once (prefetch kept to 1). One process is the
whole job here, so the smaller of the two holds; ``--jobs`` still decides when given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import distcache.cli._fetch as fetch_module
from distcache.cli import main
from distcache.testing import make_artifacts
from tests.support.helpers import clear_settings


@pytest.fixture
def threads_asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of download threads each fetch asked for."""
    asked: list[int] = []
    real = fetch_module.run_threads

    def counting(work: Any, items: Any, jobs: int, **kwargs: Any) -> Any:
        asked.append(jobs)
        return real(work, items, jobs, **kwargs)

    monkeypatch.setattr(fetch_module, "run_threads", counting)
    return asked


@pytest.mark.parametrize(("env", "argv", "expected"), [
    ({"DISTCACHE_DOWNLOADS_PER_JOB": "1"}, [], 1),
    ({"DISTCACHE_DOWNLOADS_PER_JOB": "3", "DISTCACHE_DOWNLOADS_PER_RANK": "8"}, [], 3),
    ({"DISTCACHE_DOWNLOADS_PER_RANK": "2"}, [], 2),
    ({}, [], 4),
    ({"DISTCACHE_DOWNLOADS_PER_JOB": "1"}, ["--jobs", "5"], 5),
])
def test_fetch_takes_the_smaller_of_the_rank_and_job_caps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads_asked: list[int],
    env: dict[str, str], argv: list[str], expected: int,
) -> None:
    clear_settings(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    served = tmp_path / "origin"
    make_artifacts(served, 3, min_size=100, max_size=200, seed=11)
    assert main(["--pool", str(tmp_path / "pool"), "fetch", "--manifest",
                 str(served / "checksums.txt"), "--origin", str(served), *argv]) == 0
    assert threads_asked == [expected]
