"""A publication that meets a FIFO where its scan saw a file (a tool removed its
output, something else made a pipe of that name) leaves the name out and returns;
it never waits for a writer that will not come."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from distcache.jit import Family, FamilySpec, Root, _place
from distcache.jit._place import Fresh, scan_into, settle
from distcache.store import ArtifactPool

KEY = "tool=1;py=3.11;linux"
#: Seconds a call may take before it is taken for one that hangs.
PATIENCE = 10.0


def _returns(call: Callable[[], object], fifo: Path) -> list[object]:
    """Run ``call`` on a thread; what it returned, or ``[]`` if it was still waiting
    after :data:`PATIENCE` (then the FIFO is opened for writing and closed, so that
    the waiting thread ends)."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(PATIENCE)
    if thread.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        thread.join(PATIENCE)
        return []
    return out


def _swap_for_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_settle_leaves_out_a_file_replaced_by_a_fifo(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "cache"
    root.mkdir()
    (root / "k.so").write_bytes(b"\x7fELF" + b"k" * 64)
    (root / "m.json").write_bytes(b"{}")
    fresh: list[Fresh] = []
    assert scan_into(pool, root, fresh=fresh) == []  # both just written
    assert len(fresh) == 2
    _swap_for_fifo(root / "k.so")
    out = _returns(lambda: settle(pool, fresh), root / "k.so")
    assert out, "settle waited on a FIFO"
    entries = out[0]
    assert isinstance(entries, list)
    assert [e.path for e in entries] == ["m.json"]


def test_publish_returns_when_a_fresh_file_becomes_a_fifo(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    root = tmp_path / "cache"
    root.mkdir()
    target = root / "k.so"
    target.write_bytes(b"\x7fELF" + b"k" * 64)
    real_sleep = _place.time.sleep

    def sleep_then_swap(seconds: float) -> None:
        # While the publication lets the fresh file settle, a FIFO takes its name.
        if target.is_file():
            _swap_for_fifo(target)
        real_sleep(seconds)

    monkeypatch.setattr(_place.time, "sleep", sleep_then_swap)
    family = Family(FamilySpec("deep_gemm", KEY, (Root(root),)), pool)
    out = _returns(family.publish, target)
    assert out == [0], "publish waited on a FIFO"
