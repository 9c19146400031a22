"""A foreground ``init`` interrupted (Ctrl-C) while its downloads run stops them: each
fails at its next write, so nothing reaches the pool after ``init`` raised, and the
temporary file of one still waiting on its origin is removed at once (its thread is a
daemon, cut off at the process's exit), as the command line's prefetch does."""

from __future__ import annotations

import _thread
import signal
import threading
from pathlib import Path

from distcache.artifact import Artifact, sha256_hex
from distcache.comm import local
from distcache.session import SessionSlot
from tests.support.origins import HeldOrigin

DATA = b"k" * 4096


def test_an_interrupted_init_stops_its_downloads(tmp_path: Path) -> None:
    # Ctrl-C as Python handles it by default: a test earlier in the process may have
    # left SIGINT ignored, and then interrupt_main() does nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted_init(tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_init(tmp_path: Path) -> None:
    origin = HeldOrigin(DATA)
    artifact = Artifact("k/one.cubin", sha256_hex(DATA), len(DATA))
    pool_dir = tmp_path / "pool"

    def interrupt() -> None:
        if origin.started.wait(30):
            _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    slot = SessionSlot()
    raised = None
    try:
        slot.init(comm=local(), pool=str(pool_dir), origin=origin, manifests=[[artifact]],
                  integrations=[], timeout=60)
    except KeyboardInterrupt as exc:
        raised = exc
        # The download still waits on its origin (a socket read): its file is gone.
        left = sorted(p.name for p in (pool_dir / "tmp").iterdir())
    finally:
        origin.go.set()
    assert raised is not None, "init was not interrupted"
    assert left == [], left
    assert origin.finished.wait(30)
    assert origin.outcomes == ["interrupted"]
    assert not any((pool_dir / "objects").rglob(artifact.sha256)), "published after init raised"
    assert slot.current() is None
