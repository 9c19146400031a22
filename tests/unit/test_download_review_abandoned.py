"""Downloads that a prefetch gives up on (an interrupt on the calling thread, a peer
that failed or never came) are stopped at their next write: a prefetch called
directly, with an origin that no Stopper wraps, asks the origin nothing more once it
raised, publishes nothing after it raised, and leaves no temporary file in ``tmp/``."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from pathlib import Path
from typing import BinaryIO

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective import prefetch
from distcache.collective._download import download_objects
from distcache.comm import local
from distcache.store import ArtifactPool

pytestmark = pytest.mark.timeout(120)

DATA = bytes(range(256)) * 64  # 16 KiB, written 256 bytes at a time
CHUNK = 256


class DripOrigin:
    """Writes ``DATA`` a chunk every ``pause`` seconds; counts the chunks it wrote."""

    def __init__(self, pause: float = 0.05) -> None:
        self.pause = pause
        self.written = 0
        self.started = threading.Event()
        self.ended = threading.Event()
        self.outcome: str | None = None

    def describe(self) -> str:
        return "drip://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        raise AssertionError("streamed only")

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        try:
            for at in range(0, len(DATA), CHUNK):
                out.write(DATA[at:at + CHUNK])
                self.written += 1
                self.started.set()
                time.sleep(self.pause)
            self.outcome = "finished"
            return len(DATA)
        except BaseException as exc:
            self.outcome = type(exc).__name__
            raise
        finally:
            self.ended.set()


def _tmp_emptied(tmp: Path, seconds: float = 5.0) -> bool:
    """Whether ``tmp`` is empty within ``seconds`` (the worker removes its file just
    after the origin's call returns)."""
    deadline = time.monotonic() + seconds
    while any(tmp.iterdir()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


ARTIFACT = Artifact("k/drip.cubin", sha256_hex(DATA), len(DATA))


def test_an_interrupted_prefetch_stops_its_running_download(tmp_path: Path) -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupted(tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(tmp_path: Path) -> None:
    origin = DripOrigin()
    pool = ArtifactPool(tmp_path / "pool")

    def interrupt() -> None:
        if origin.started.wait(30):
            _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    raised = None
    try:
        prefetch([ARTIFACT], comm=local(), pool=pool, origin=origin, timeout=30)
    except KeyboardInterrupt as exc:
        raised = exc
        at_raise = origin.written
    assert raised is not None, "the prefetch was not interrupted"
    assert origin.ended.wait(30)
    # At most the write under way when the interrupt came; not the other 60 chunks.
    assert origin.written <= at_raise + 1, (at_raise, origin.written)
    assert origin.outcome != "finished"
    assert not pool.has(ARTIFACT.sha256), "published after the prefetch raised"
    assert _tmp_emptied(tmp_path / "pool" / "tmp")


def test_a_stalled_download_given_up_stops_the_others(tmp_path: Path) -> None:
    # Nothing arrives for longer than the timeout (one download never sends a byte,
    # the other sends its first late): once the stall is reported, the late one is
    # not left to run on.
    class Stuck(DripOrigin):
        def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
            if artifact.name == "k/stuck.cubin":
                for _ in range(600):  # no byte, but the empty write an HTTP origin
                    time.sleep(0.1)   # makes between reads to look for a stop
                    out.write(b"")
                return 0
            time.sleep(2.0)
            return super().fetch_into(artifact, out)

    origin = Stuck()
    pool = ArtifactPool(tmp_path / "pool")
    stuck = Artifact("k/stuck.cubin", "0" * 64, 10)
    got = download_objects(pool, origin, [stuck, ARTIFACT], workers=2, timeout=1.0)
    assert got.failure is not None and "stalling" in str(got.failure[1])
    assert origin.ended.wait(30)
    assert origin.written == 0 and origin.outcome == "Interrupted", origin.outcome
    assert not pool.has(ARTIFACT.sha256)
    assert _tmp_emptied(tmp_path / "pool" / "tmp")
