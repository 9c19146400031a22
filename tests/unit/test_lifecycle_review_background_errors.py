"""What a failed background start-up raised reaches someone: each ``Session.wait``
raises it from where the start-up raised it (not from the waits before), and a program
that neither waits nor closes has it logged at its exit rather than lost."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.errors import ConfigError
from distcache.session import Session, SessionSlot
from tests.support.cli import REPO
from tests.support.helpers import isolated_init

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0  # what any wait of a test allows before it fails


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


def _failing(tmp_path: Path) -> Session:
    """A background start-up that fails: an artifact in no pool, and no origin."""
    return SessionSlot().init(pool=tmp_path / "pool", integrations=[], background=True,
                              manifests=[[Artifact("a.bin", "0" * 64)]], timeout=WAIT_S)


def _raised(session: Session, caller: str) -> list[str]:
    """The functions of the traceback of what ``session.wait`` raised, called from a
    function named ``caller``."""
    def call() -> None:
        session.wait(WAIT_S)

    call.__code__ = call.__code__.replace(co_name=caller)
    with pytest.raises(ConfigError) as caught:
        call()
    return [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]


def test_each_wait_raises_the_error_from_where_the_start_up_raised_it(
        tmp_path: Path) -> None:
    session = _failing(tmp_path)
    try:
        first = _raised(session, "first_waiter")
        second = _raised(session, "second_waiter")
        third = _raised(session, "third_waiter")
    finally:
        session.close()
    assert "first_waiter" in first
    # A later wait's traceback has its own caller, not the earlier waits' frames.
    assert "first_waiter" not in second and "second_waiter" in second, second
    assert "second_waiter" not in third and len(third) == len(second) == len(first), third


_NEITHER = textwrap.dedent("""
    import sys, time
    from distcache.artifact import Artifact
    from distcache.session import SessionSlot

    session = SessionSlot().init(pool=sys.argv[1], integrations=[], background=True,
                                 manifests=[[Artifact("a.bin", "0" * 64)]], timeout=30)
    until = time.monotonic() + 30
    while not session.ready and time.monotonic() < until:
        time.sleep(0.01)
    if sys.argv[2] == "wait":
        try:
            session.wait()
        except Exception as exc:
            print("raised", type(exc).__name__, flush=True)
    elif sys.argv[2] == "close":
        session.close()
    print("exiting", flush=True)
""")


def _exit_after(tmp_path: Path, then: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", _NEITHER, str(tmp_path / "pool"), then],
                          capture_output=True, text=True, timeout=90, cwd=REPO,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout
    return done


def test_a_failure_nobody_waited_for_or_closed_is_logged_at_the_exit(tmp_path: Path) -> None:
    done = _exit_after(tmp_path, "neither")
    assert "background start-up failed" in done.stderr and "a.bin" in done.stderr, done.stderr


@pytest.mark.parametrize("then", ["wait", "close"])
def test_a_failure_raised_by_wait_or_logged_by_close_is_not_logged_again_at_the_exit(
        tmp_path: Path, then: str) -> None:
    done = _exit_after(tmp_path, then)
    said = [line for line in done.stderr.splitlines() if "background start-up failed" in line]
    assert len(said) == (1 if then == "close" else 0), done.stderr
