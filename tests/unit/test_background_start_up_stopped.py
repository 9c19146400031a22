"""A background start-up that has not ended when its session is closed, or when the
process exits without a close, has its downloads stopped: each fails at its next
write (no retry, nothing published), and the temporary file of one still waiting on
its origin is removed, instead of the close waiting for every download and retry and
the exit cutting the daemon threads off mid-write."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.comm import local
from distcache.session import SessionSlot
from tests.support.cli import REPO
from tests.support.origins import HeldOrigin

pytestmark = pytest.mark.timeout(120)

DATA = b"b" * 4096


def _tmp_files(pool: Path) -> list[str]:
    return sorted(p.name for p in (pool / "tmp").iterdir())


def test_a_close_before_the_background_start_up_ended_stops_its_downloads(
        tmp_path: Path) -> None:
    origin = HeldOrigin(DATA)
    artifact = Artifact("b/one.cubin", sha256_hex(DATA), len(DATA))
    pool = tmp_path / "pool"
    session = SessionSlot().init(comm=local(), pool=str(pool), origin=origin,
                                 manifests=[[artifact]], integrations=[], timeout=60,
                                 background=True)
    assert origin.started.wait(30)
    assert _tmp_files(pool), "the download writes no temporary file"
    closing = threading.Thread(target=session.close, daemon=True)
    closing.start()
    # While the download still waits on its origin, its file is removed...
    until = time.monotonic() + 30
    while _tmp_files(pool) and time.monotonic() < until:
        time.sleep(0.01)
    left = _tmp_files(pool)
    origin.go.set()  # ...and its next write fails
    closing.join(30)
    assert not closing.is_alive()
    assert left == [], left
    assert origin.outcomes == ["interrupted"]
    assert origin.calls == 1  # not asked again
    assert not any((pool / "objects").rglob(artifact.sha256))
    assert session.closed


_EXITING = textwrap.dedent("""
    import sys, threading
    from distcache.artifact import Artifact, sha256_hex
    from distcache.comm import local
    from distcache.origins import BaseOrigin
    from distcache.session import SessionSlot

    DATA = b"b" * 4096
    started = threading.Event()

    class Held(BaseOrigin):
        def describe(self):
            return "held"

        def fetch_into(self, artifact, out):
            out.write(DATA[:2048])
            started.set()
            threading.Event().wait(600)  # an origin that never sends the rest
            out.write(DATA[2048:])
            return len(DATA)

    artifact = Artifact("b/one.cubin", sha256_hex(DATA), len(DATA))
    SessionSlot().init(comm=local(), pool=sys.argv[1], origin=Held(),
                       manifests=[[artifact]], integrations=[], timeout=600,
                       background=True)
    assert started.wait(60)
    print("exiting", flush=True)
    sys.exit(0)  # no close: the program ends while the start-up downloads
""")


def test_an_exit_during_the_background_start_up_leaves_no_temporary_file(
        tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    done = subprocess.run([sys.executable, "-c", _EXITING, str(pool)], capture_output=True,
                          text=True, timeout=90, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout
    assert _tmp_files(pool) == [], done.stderr


def test_a_foreground_init_that_finds_a_background_start_up_waits_for_it(
        tmp_path: Path) -> None:
    # An engine started in the background; a library it embeds calls init() and takes
    # the pool for filled when it returns, as a foreground init promises.
    origin = HeldOrigin(DATA)
    artifact = Artifact("b/one.cubin", sha256_hex(DATA), len(DATA))
    slot = SessionSlot()
    session = slot.init(comm=local(), pool=str(tmp_path / "pool"), origin=origin,
                        manifests=[[artifact]], integrations=[], timeout=60, background=True)
    try:
        assert origin.started.wait(30)
        found: list[object] = []
        library = threading.Thread(target=lambda: found.append(slot.init()), daemon=True)
        library.start()
        library.join(0.5)
        assert library.is_alive(), "init returned while the start-up still downloads"
        assert slot.init(background=True) is session  # a background one returns at once
        origin.go.set()
        library.join(30)
        assert found == [session] and session.ready
        assert session.report is not None and session.report.downloads == 1
    finally:
        origin.go.set()
        session.close()
