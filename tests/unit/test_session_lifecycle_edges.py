"""A session's life at its edges: a ``close`` interrupted while it waits for the
background start-up, ``init`` called again from inside its own start-up (a library the
engine embeds, installed as an integration, calling ``init`` too), a background
start-up that failed and a corrected retry, and a fork while the start-up runs.

Interleavings are forced with events: an integration whose install waits until the
test releases it keeps the start-up running for as long as the test needs. A thread
inside ``Session.close`` is watched with ``sys.setprofile``, whose function also
raises the Ctrl-C where ``close`` waits for the start-up. Every wait has a timeout, so
a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.errors import CollectiveTimeout, ConfigError, DistcacheError
from distcache.session import Session, SessionSlot
from tests.support.helpers import isolated_init, on_threads, watch_close
from tests.unit.test_session_close import Noted

WAIT_S = 30.0  # what any wait of a test allows before it fails


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


class Held(Noted):
    """An integration whose install says so with ``installing``, then waits until
    ``release`` is set."""

    def __init__(self, name: str, notes: list[str]) -> None:
        super().__init__(name, notes)
        self.installing, self.release = threading.Event(), threading.Event()

    def install(self, pool: Any, origin: Any) -> None:
        self.installing.set()
        if not self.release.wait(WAIT_S):
            raise AssertionError("the test never released the install")
        super().install(pool, origin)


def _held_start_up(tmp_path: Path, *later: str
                   ) -> tuple[list[str], Held, SessionSlot, Session]:
    """A background start-up in a slot of its own whose first install is held, a
    ``Noted`` integration named for each of ``later`` after it: the notes they keep,
    the held integration, the slot and the session."""
    notes: list[str] = []
    held = Held("held", notes)
    slot = SessionSlot()
    session = slot.init(pool=tmp_path / "pool",
                        integrations=[held, *(Noted(name, notes) for name in later)],
                        background=True, timeout=WAIT_S)
    return notes, held, slot, session


def _close_quietly(*sessions: Session | None) -> None:
    for session in sessions:
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()


# -- a close interrupted while it waits for the background start-up -----------------


def _interrupting(before: Callable[[], None]) -> Callable[[FrameType, str, Any], None]:
    """A profile function that, once the thread inside ``Session.close`` reaches a lock
    (where it waits for the start-up), calls ``before`` and raises ``KeyboardInterrupt``
    there, as a Ctrl-C during that wait does."""
    inside = threading.Event()
    watch = watch_close(inside)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        watch(frame, event, arg)
        if inside.is_set():
            before()
            raise KeyboardInterrupt

    return profile


def _interrupted_close(session: Session, before: Callable[[], None] = lambda: None
                       ) -> BaseException | None:
    """``session.close()``, interrupted once it waits for the start-up; what it raised."""
    raised: BaseException | None = None
    sys.setprofile(_interrupting(before))
    try:
        session.close()
    except BaseException as exc:
        raised = exc
    finally:
        sys.setprofile(None)
    return raised


def test_a_close_interrupted_while_the_start_up_runs_leaves_the_session_closable(
    tmp_path: Path,
) -> None:
    notes, held, slot, session = _held_start_up(tmp_path, "later")
    try:
        assert held.installing.wait(WAIT_S)
        raised = _interrupted_close(session)
        assert isinstance(raised, KeyboardInterrupt), raised
        # The start-up still runs: nothing says it is over.
        assert not session.ready and not session.closed
        with pytest.raises(CollectiveTimeout):
            session.wait(0)
        held.release.set()
        session.wait(WAIT_S)
        assert notes == ["install held", "install later"]
        # A later close tears down what the start-up installed.
        session.close()
        assert session.closed and slot.current() is None
        assert notes == ["install held", "install later", "uninstall later", "uninstall held"]
    finally:
        held.release.set()
        _close_quietly(session)


def test_a_close_waiting_behind_an_interrupted_one_tears_the_session_down(
    tmp_path: Path,
) -> None:
    notes, held, slot, session = _held_start_up(tmp_path)
    waiting = threading.Event()  # the second close is inside close(), at a lock
    second: list[BaseException] = []

    def close_too() -> None:
        sys.setprofile(watch_close(waiting))
        try:
            session.close()
        except BaseException as exc:
            second.append(exc)
        finally:
            sys.setprofile(None)

    other = threading.Thread(target=close_too, daemon=True, name="second-close")

    def start_the_second() -> None:
        other.start()
        assert waiting.wait(WAIT_S), "the second close never came"

    try:
        assert held.installing.wait(WAIT_S)
        raised = _interrupted_close(session, start_the_second)
        assert isinstance(raised, KeyboardInterrupt), raised
        held.release.set()
        other.join(WAIT_S)
        assert not other.is_alive() and second == []
        # The second close took the teardown over once the first gave it up.
        assert session.closed and slot.current() is None
        assert notes == ["install held", "uninstall held"]
    finally:
        held.release.set()
        _close_quietly(session)


# -- init called from inside its own start-up ----------------------------------------


class Embedding(Noted):
    """An integration whose install calls ``init`` on ``slot`` (as a library the
    engine embeds does) and keeps what it returned or raised."""

    def __init__(self, name: str, notes: list[str], slot: SessionSlot, *,
                 beside: bool) -> None:
        super().__init__(name, notes)
        self.slot, self.install_beside_prefetch = slot, beside
        self.inner: list[Any] = []

    def install(self, pool: Any, origin: Any) -> None:
        try:
            self.inner.append(self.slot.init(integrations=[Noted("inner", self.notes)]))
        except BaseException as exc:
            self.inner.append(exc)
        super().install(pool, origin)


@pytest.mark.parametrize("background", [False, True])
def test_init_from_an_install_after_the_prefetch_gets_the_session_being_started(
    tmp_path: Path, background: bool,
) -> None:
    notes: list[str] = []
    slot = SessionSlot()
    embedding = Embedding("embedding", notes, slot, beside=False)
    outer = slot.init(pool=tmp_path / "pool", integrations=[embedding],
                      background=background, timeout=WAIT_S)
    try:
        outer.wait(WAIT_S)
        assert embedding.inner == [outer]
        assert notes == ["install embedding"]  # no second session installed its own
        assert slot.current() is outer
        outer.close()
        assert notes == ["install embedding", "uninstall embedding"]
        assert slot.current() is None
    finally:
        _close_quietly(outer, *[s for s in embedding.inner if isinstance(s, Session)])


def test_init_from_an_install_beside_the_prefetch_gets_the_session_being_started(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    slot = SessionSlot()
    embedding = Embedding("embedding", notes, slot, beside=True)
    [outer] = on_threads(1, lambda rank: slot.init(
        pool=tmp_path / "pool", integrations=[embedding], timeout=WAIT_S), join=WAIT_S)
    try:
        assert isinstance(outer, Session), outer
        assert embedding.inner == [outer]
        assert notes == ["install embedding"]
        outer.close()
        assert notes == ["install embedding", "uninstall embedding"]
        assert slot.current() is None
    finally:
        _close_quietly(outer if isinstance(outer, Session) else None,
                       *[s for s in embedding.inner if isinstance(s, Session)])


# -- a background start-up that failed, and a corrected retry ------------------------


def _failing(tmp_path: Path, slot: SessionSlot, notes: list[str]) -> Session:
    """A background start-up that fails: an artifact in no pool, and no origin."""
    return slot.init(pool=tmp_path / "pool", integrations=[Noted("first", notes)],
                     background=True, manifests=[[Artifact("a.bin", "0" * 64)]],
                     timeout=WAIT_S)


def test_a_retry_after_a_failed_background_start_up_starts_afresh(tmp_path: Path) -> None:
    notes: list[str] = []
    slot = SessionSlot()
    failed = _failing(tmp_path, slot, notes)
    retry: Session | None = None
    try:
        with pytest.raises(ConfigError, match=r"a\.bin"):
            failed.wait(WAIT_S)
        retry = slot.init(pool=tmp_path / "pool", integrations=[Noted("second", notes)],
                          background=True, timeout=WAIT_S)
        assert retry is not failed
        retry.wait(WAIT_S)
        assert slot.current() is retry and not retry.closed
        assert notes == ["install second"]
        # The failed session stays failed for whoever holds it.
        assert failed.closed
        with pytest.raises(ConfigError, match=r"a\.bin"):
            failed.wait(0)
        with pytest.raises(DistcacheError):
            failed.sync()
        failed.close()  # leaves the retry's session in the slot
        assert slot.current() is retry
    finally:
        _close_quietly(retry, failed)


# -- a fork while the background start-up runs ---------------------------------------


def _in_child(session: Session) -> dict[str, str]:
    """What ``ready``, ``wait`` and ``close`` of ``session`` do in a forked child."""
    out: dict[str, str] = {}
    for what, call in (("ready", lambda: session.ready), ("wait", lambda: session.wait(5)),
                       ("close", session.close)):
        try:
            out[what] = f"returned {call()!r}"
        except BaseException as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    return out


def test_in_a_forked_child_the_parents_start_up_is_not_taken_for_its_own(
    tmp_path: Path,
) -> None:
    notes, held, _slot, session = _held_start_up(tmp_path)
    try:
        assert held.installing.wait(WAIT_S)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running any of pytest's
            try:
                os.write(write, json.dumps(_in_child(session)).encode())
            finally:
                os._exit(0)
        os.close(write)
        try:
            ready, _, _ = select.select([read], [], [], WAIT_S)
            said = json.loads(os.read(read, 65536).decode()) if ready else None
        finally:
            os.close(read)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert said is not None, "the child did not answer"
        for what in ("ready", "wait"):
            assert said[what].startswith("DistcacheError") and "parent" in said[what], said
        assert said["close"] == "returned None", said
        # The parent's start-up is untouched.
        assert not session.ready
        held.release.set()
        session.wait(WAIT_S)
        assert session.ready and notes == ["install held"]
    finally:
        held.release.set()
        _close_quietly(session)
