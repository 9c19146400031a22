"""Slurm host-list expansion."""

from __future__ import annotations

import pytest

from launch import LaunchError, expand_nodelist
from launch._nodelist import MAX_HOSTS, expand_counts


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("n[009-011]", ["n009", "n010", "n011"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu-[1-2],cpu-3", ["gpu-1", "gpu-2", "cpu-3"]),
        ("x[1-3]-ib", ["x1-ib", "x2-ib", "x3-ib"]),
        (
            "host[1,5-7],login,gpu[08,10]",
            ["host1", "host5", "host6", "host7", "login", "gpu08", "gpu10"],
        ),
        ("1.2.3.[100-102]", ["1.2.3.100", "1.2.3.101", "1.2.3.102"]),
        ("alpha, host[5-6], gamma", ["alpha", "host5", "host6", "gamma"]),
        ("n[5]", ["n5"]),
        ("[1-2]", ["1", "2"]),
    ],
)
def test_compressed_list_expands_in_slurm_order(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "gpu[01-03",
        "gpu01-03]",
        "gpu[[1-2]]",
        "gpu[]",
        "gpu[3-1]",
        "gpu[a-b]",
        "gpu[1-]",
        "gpu[-2]",
        "a,,b",
        "a,",
        ",a",
        "gpu[1-2,]",
        "gp u1",
        "n[0-99999999]",
        "a[0-999]b[0-9999]",
    ],
)
def test_malformed_list_raises_launch_error(text: str) -> None:
    with pytest.raises(LaunchError, match="malformed Slurm node list") as err:
        expand_nodelist(text)
    assert err.value.value == text


def test_expansion_is_capped() -> None:
    assert len(expand_nodelist(f"n[1-{MAX_HOSTS}]")) == MAX_HOSTS
    with pytest.raises(LaunchError):
        expand_nodelist(f"n[0-{MAX_HOSTS}]")


@pytest.mark.parametrize(
    ("text", "counts"),
    [("3", [3]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2]), ("1(x1)", [1])],
)
def test_task_counts_expand(text: str, counts: list[int]) -> None:
    assert expand_counts(text) == counts


@pytest.mark.parametrize("text", ["", "2(x", "2(3)", "x", "2(x0)", "-1", "2,,1"])
def test_malformed_task_counts_raise(text: str) -> None:
    with pytest.raises(LaunchError, match="task counts"):
        expand_counts(text)
