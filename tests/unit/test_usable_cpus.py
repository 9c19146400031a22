"""The cores a host's ranks count on when spacing their polls: their control group's
CPU set (else the host's cores), within its CPU quota; never one rank's own binding."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from distcache.comm._base import _cpu_list_size, usable_cpus

HOST = float(os.cpu_count() or 1)


def _cgroup(root: Path, *, cpuset: str | None = None, v1_cpuset: str | None = None,
            v2: str | None = None, v1: tuple[str, str] | None = None) -> Any:
    root.mkdir(parents=True, exist_ok=True)
    files = ((str(root / "cpuset.cpus.effective"), str(root / "cpuset.effective_cpus")),
             str(root / "cpu.max"),
             (str(root / "cpu.cfs_quota_us"), str(root / "cpu.cfs_period_us")))
    for text, path in ((cpuset, files[0][0]), (v1_cpuset, files[0][1]), (v2, files[1])):
        if text is not None:
            Path(path).write_text(text + "\n")
    if v1 is not None:
        Path(files[2][0]).write_text(v1[0] + "\n")
        Path(files[2][1]).write_text(v1[1] + "\n")
    return files


def test_without_a_control_group_the_cores_are_the_hosts(tmp_path: Path) -> None:
    assert usable_cpus(_cgroup(tmp_path / "none")) == HOST
    assert usable_cpus(_cgroup(tmp_path / "v2", v2="max 100000")) == HOST
    assert usable_cpus(_cgroup(tmp_path / "v1", v1=("-1", "100000"))) == HOST


def test_a_containers_cpu_set_and_quota_cap_them(tmp_path: Path) -> None:
    assert usable_cpus(_cgroup(tmp_path / "set", cpuset="0")) == 1.0
    assert usable_cpus(_cgroup(tmp_path / "v1set", v1_cpuset="0")) == 1.0
    assert usable_cpus(_cgroup(tmp_path / "quota", v2="150000 100000")) == min(HOST, 1.5)
    assert usable_cpus(_cgroup(tmp_path / "small", v1=("50000", "100000"))) == 1.0  # at least 1
    assert usable_cpus(_cgroup(tmp_path / "big", v2=f"{int(HOST) * 400000} 100000")) == HOST


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_a_rank_bound_to_one_core_still_counts_the_hosts(tmp_path: Path) -> None:
    # mpirun --bind-to core gives each rank one core of its own: the ranks still each
    # have one, so the count is not this process's affinity.
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})
    try:
        assert usable_cpus(_cgroup(tmp_path)) == HOST
    finally:
        os.sched_setaffinity(0, mine)


def test_unreadable_figures_count_as_none(tmp_path: Path) -> None:
    assert usable_cpus(_cgroup(tmp_path / "a", v2="garbage")) == HOST
    assert usable_cpus(_cgroup(tmp_path / "b", v2="0 100000")) == HOST
    assert usable_cpus(_cgroup(tmp_path / "c", v1=("100000", "0"))) == HOST
    assert usable_cpus(_cgroup(tmp_path / "d", cpuset="3-1")) == HOST
    assert [_cpu_list_size(t) for t in ("0-3,8,10-11", "5", "", "x", "2-")] == [7, 1, 0, 0, 0]
