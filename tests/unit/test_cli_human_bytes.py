"""Sizes for people, the same in every command: bytes up to EiB, then scientific form
(an absurd cap reads as what it is, and one past a float's range prints at all)."""

from __future__ import annotations

import pytest

from distcache.cli._common import human_bytes

CASES: list[tuple[float | None, str]] = [
    (None, "unlimited"),
    (0, "0 B"),
    (1023, "1023 B"),
    (1536, "1.5 KiB"),
    (3 << 30, "3.0 GiB"),
    (1 << 40, "1.0 TiB"),
    (5 << 50, "5.0 PiB"),
    (3 << 60, "3.0 EiB"),
    (1023 << 60, "1023.0 EiB"),
    (10 ** 30, "1.0e+30 B"),
    (10 ** 400, "1.0e+400 B"),
    (2.5e9, "2.3 GiB"),
]


@pytest.mark.parametrize(("size", "shown"), CASES, ids=[shown for _, shown in CASES])
def test_sizes_read_as_people_write_them(size: float | None, shown: str) -> None:
    assert human_bytes(size) == shown
