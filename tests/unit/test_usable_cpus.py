"""The cores a rank's polling counts on: its affinity, within its control group's quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distcache.comm._base import usable_cpus


def _cgroup(tmp_path: Path, v2: str | None = None, v1: tuple[str, str] | None = None
            ) -> tuple[str, tuple[str, str]]:
    files = (str(tmp_path / "cpu.max"),
             (str(tmp_path / "cpu.cfs_quota_us"), str(tmp_path / "cpu.cfs_period_us")))
    if v2 is not None:
        Path(files[0]).write_text(v2 + "\n")
    if v1 is not None:
        Path(files[1][0]).write_text(v1[0] + "\n")
        Path(files[1][1]).write_text(v1[1] + "\n")
    return files


@pytest.fixture
def cores() -> float:
    return float(len(os.sched_getaffinity(0)))


def test_without_a_quota_the_cores_are_those_it_may_run_on(tmp_path: Path,
                                                           cores: float) -> None:
    assert usable_cpus(_cgroup(tmp_path)) == cores  # no cgroup files at all
    assert usable_cpus(_cgroup(tmp_path, v2="max 100000")) == cores
    (tmp_path / "v1").mkdir()
    assert usable_cpus(_cgroup(tmp_path / "v1", v1=("-1", "100000"))) == cores


def test_a_containers_quota_caps_them(tmp_path: Path, cores: float) -> None:
    assert usable_cpus(_cgroup(tmp_path, v2="150000 100000")) == min(cores, 1.5)
    (tmp_path / "v1").mkdir()
    assert usable_cpus(_cgroup(tmp_path / "v1", v1=("50000", "100000"))) == 1.0  # at least one
    (tmp_path / "big").mkdir()
    assert usable_cpus(_cgroup(tmp_path / "big", v2=f"{int(cores) * 400000} 100000")) == cores


def test_an_unreadable_quota_is_no_quota(tmp_path: Path, cores: float) -> None:
    assert usable_cpus(_cgroup(tmp_path, v2="garbage")) == cores
    (tmp_path / "zero").mkdir()
    assert usable_cpus(_cgroup(tmp_path / "zero", v2="0 100000")) == cores
