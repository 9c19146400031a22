"""FlashInfer's direct downloads served by the pool hold the artifact once: a file
at the destination that cannot be replaced is compared with the served bytes a piece
at a time, never read whole beside them."""

from __future__ import annotations

import logging
import os
import tracemalloc
from pathlib import Path

import pytest

from distcache.integrations.flashinfer import _download
from distcache.integrations.flashinfer._download import _write

SIZE = 16 << 20
#: Peak traced memory of one write, as a multiple of the artifact's size (the served
#: bytes are already held by the caller: anything near 1 is a second copy).
BOUND = 0.25


@pytest.fixture(scope="module")
def big() -> bytes:
    return os.urandom(SIZE)


def _unreplaceable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The destination is not this user's (never left in place as its own) and
    cannot be replaced: ``_write`` falls back to checking what it holds."""
    def refuse(root: Path, target: Path, data: bytes) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(_download, "own_holds", lambda root, target, data: False)
    monkeypatch.setattr(_download, "write_replacing", refuse)


def _peak(destination: Path, data: bytes) -> tuple[bool, float]:
    tracemalloc.start()
    try:
        answer = _write(destination, data, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return answer, peak / SIZE


def test_a_kept_destination_is_compared_without_a_second_copy(
    tmp_path: Path, big: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _unreplaceable(monkeypatch)
    destination = tmp_path / "cubins" / "big.cubin"
    destination.parent.mkdir()
    destination.write_bytes(big)
    with caplog.at_level(logging.WARNING):
        answer, peak = _peak(destination, big)
    assert answer is True
    assert "holds the right bytes" in caplog.text
    assert peak < BOUND, f"comparing the destination held {peak:.2f} times the artifact"


@pytest.mark.parametrize("other", ["last byte", "shorter", "longer"])
def test_a_destination_with_other_bytes_is_still_refused(
    tmp_path: Path, big: bytes, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, other: str,
) -> None:
    _unreplaceable(monkeypatch)
    destination = tmp_path / "big.cubin"
    held = {"last byte": big[:-1] + bytes([big[-1] ^ 1]), "shorter": big[:-1],
            "longer": big + b"\0"}[other]
    destination.write_bytes(held)
    with caplog.at_level(logging.ERROR):
        answer, peak = _peak(destination, big)
    assert answer is False
    assert f"cannot write {destination}" in caplog.text
    assert peak < BOUND, f"comparing the destination held {peak:.2f} times the artifact"


def test_a_fifo_at_the_destination_is_not_opened_for_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _unreplaceable(monkeypatch)
    destination = tmp_path / "big.cubin"
    os.mkfifo(destination)
    assert _write(destination, b"data", None) is False
