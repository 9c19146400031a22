"""``Session.close`` from awkward places: the background start-up's own thread (an
install that gives up and closes the session it is starting), and two threads at once.
Exactly one teardown runs, nobody joins itself, and no caller returns before the
teardown is over.

Where a test must know that another thread is inside ``close`` it watches that thread
with ``sys.setprofile``: an event is set when the thread enters ``Session.close`` and
reaches a lock there (where it may block), or returns from it. No test waits for time
to pass; every wait has a timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from distcache.errors import ConfigError, DistcacheError
from distcache.session import Session, SessionSlot
from tests.support.helpers import PlainIntegration, isolated_init, watch_close

WAIT_S = 30.0  # what any wait of a test allows before it fails


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


class CountingSlot(SessionSlot):
    """A slot that counts how often a session left it (once per teardown)."""

    def __init__(self) -> None:
        super().__init__()
        self.left = 0

    def leave(self, session: Session) -> None:
        self.left += 1
        super().leave(session)


class Noted(PlainIntegration):
    """An integration that notes its install and uninstall, with the thread of each."""

    def __init__(self, name: str, notes: list[str]) -> None:
        self.name, self.notes = name, notes

    def install(self, pool: Any, origin: Any) -> None:
        self.notes.append(f"install {self.name}")

    def uninstall(self) -> None:
        self.notes.append(f"uninstall {self.name}")


class ClosesOnInstall(Noted):
    """An integration whose install closes the session it is installed by (given once
    ``init`` returned), then raises an error of its own or returns."""

    def __init__(self, name: str, notes: list[str], *, then_raise: bool) -> None:
        super().__init__(name, notes)
        self.then_raise = then_raise
        self.session: Session | None = None
        self.given = threading.Event()
        self.thread = ""

    def install(self, pool: Any, origin: Any) -> None:
        if not self.given.wait(WAIT_S) or self.session is None:
            raise AssertionError("the test never gave the session")
        self.thread = threading.current_thread().name
        super().install(pool, origin)
        self.session.close()
        if self.then_raise:
            raise ConfigError(f"{self.name} gave up", variable="x", value=None)


def _background(tmp_path: Path, slot: SessionSlot, chosen: list[Any]) -> Session:
    session = slot.init(pool=tmp_path / "pool", integrations=chosen, background=True,
                        timeout=WAIT_S)
    for integration in chosen:
        if isinstance(integration, ClosesOnInstall):
            integration.session = session
            integration.given.set()
    return session


def test_an_install_that_closes_its_session_on_the_start_up_thread_then_raises(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    closer = ClosesOnInstall("closer", notes, then_raise=True)
    slot = CountingSlot()
    session = _background(tmp_path, slot, [Noted("first", notes), closer,
                                           Noted("later", notes)])
    with pytest.raises(ConfigError, match="closer gave up"):  # its own error, no join error
        session.wait(WAIT_S)
    assert closer.thread == "distcache-start-up"
    assert session.ready and session.closed
    assert notes == ["install first", "install closer", "uninstall first"]
    assert slot.left == 1 and slot.current() is None
    session.close()  # later calls return at once and tear nothing down again
    assert notes == ["install first", "install closer", "uninstall first"]
    assert slot.left == 1


def test_an_install_that_closes_its_session_and_returns_ends_the_start_up(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    closer = ClosesOnInstall("closer", notes, then_raise=False)
    slot = CountingSlot()
    session = _background(tmp_path, slot, [Noted("first", notes), closer,
                                           Noted("later", notes)])
    with pytest.raises(DistcacheError, match="closed during its start-up"):
        session.wait(WAIT_S)
    assert closer.thread == "distcache-start-up"
    # The install that closed the session came back installed: it is uninstalled
    # rather than kept by a closed session, and nothing after it is installed.
    assert notes == ["install first", "install closer", "uninstall first",
                     "uninstall closer"]
    assert [i.name for i in session.integrations] == ["first"]
    assert slot.left == 1 and slot.current() is None
    session.close()
    assert slot.left == 1 and notes.count("uninstall first") == 1


def _on_thread(body: Callable[[], None], name: str,
               profile: Callable[[FrameType, str, Any], None] | None = None
               ) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        if profile is not None:
            sys.setprofile(profile)
        try:
            body()
        except BaseException as exc:
            raised.append(exc)
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, raised


class BlocksUninstall(Noted):
    """An integration whose uninstall (a teardown step) waits until ``release`` is set,
    after saying so with ``tearing``."""

    def __init__(self, name: str, notes: list[str], release: threading.Event) -> None:
        super().__init__(name, notes)
        self.tearing, self.release = threading.Event(), release

    def uninstall(self) -> None:
        self.tearing.set()
        if not self.release.wait(WAIT_S):
            raise AssertionError("the second close never came")
        super().uninstall()
        self.notes.append("teardown over")


def _closing(session: Session, name: str, notes: list[str], settled: threading.Event
             ) -> Callable[[], None]:
    """``session.close()``, then a note that it returned and ``settled`` set."""
    def body() -> None:
        try:
            session.close()
        finally:
            notes.append(f"{name} returned")
            settled.set()
    return body


def test_two_threads_closing_at_once_tear_down_once_and_both_return_after_it(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    settled = threading.Event()  # the second close is inside close() or has returned
    blocking = BlocksUninstall("blocking", notes, settled)
    slot = CountingSlot()
    session = slot.init(pool=tmp_path / "pool", integrations=[blocking])
    first, first_raised = _on_thread(_closing(session, "first", notes, threading.Event()),
                                     "first-closer")
    assert blocking.tearing.wait(WAIT_S), "the first close never reached the teardown"
    second, second_raised = _on_thread(_closing(session, "second", notes, settled),
                                       "second-closer", watch_close(settled))
    for thread in (first, second):
        thread.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive(), "a close hung"
    assert first_raised == [] and second_raised == []
    assert notes[:3] == ["install blocking", "uninstall blocking", "teardown over"]
    assert sorted(notes[3:]) == ["first returned", "second returned"]
    assert slot.left == 1 and session.closed and slot.current() is None
    session.close()  # a later call returns at once
    assert notes.count("uninstall blocking") == 1 and slot.left == 1


class FailsUninstall(BlocksUninstall):
    def uninstall(self) -> None:
        super().uninstall()
        raise RuntimeError(f"{self.name} cannot uninstall")


def test_only_the_close_that_tore_down_raises_what_the_teardown_raised(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    settled = threading.Event()
    failing = FailsUninstall("failing", notes, settled)
    slot = CountingSlot()
    session = slot.init(pool=tmp_path / "pool", integrations=[failing])
    first, first_raised = _on_thread(_closing(session, "first", notes, threading.Event()),
                                     "first-closer")
    assert failing.tearing.wait(WAIT_S), "the first close never reached the teardown"
    second, second_raised = _on_thread(_closing(session, "second", notes, settled),
                                       "second-closer", watch_close(settled))
    for thread in (first, second):
        thread.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive(), "a close hung"
    # The caller that tore down raises what failed, as a lone close() does, and the
    # slot is left all the same; the other caller waited for it and raises nothing.
    assert [str(e) for e in first_raised] == ["failing cannot uninstall"]
    assert second_raised == []
    assert notes[:3] == ["install failing", "uninstall failing", "teardown over"]
    assert sorted(notes[3:]) == ["first returned", "second returned"]
    assert slot.left == 1 and slot.current() is None


def test_the_start_up_thread_closing_while_another_close_joins_it_does_not_deadlock(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    joining = threading.Event()  # the other close is inside close(), joining the start-up

    class ClosesLate(Noted):
        session: Session | None = None
        given = threading.Event()

        def install(self, pool: Any, origin: Any) -> None:
            if not self.given.wait(WAIT_S) or self.session is None:
                raise AssertionError("the test never gave the session")
            if not joining.wait(WAIT_S):
                raise AssertionError("the other close never came")
            super().install(pool, origin)
            self.session.close()  # the other close joins this thread: return at once
            notes.append("start-up's close returned")

    late = ClosesLate("late", notes)
    slot = CountingSlot()
    session = slot.init(pool=tmp_path / "pool", integrations=[late], background=True,
                        timeout=WAIT_S)
    late.session = session
    late.given.set()
    closer, raised = _on_thread(session.close, "closer", watch_close(joining))
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close deadlocked with the start-up"
    assert raised == []
    assert notes == ["install late", "start-up's close returned", "uninstall late"]
    assert slot.left == 1 and session.ready
    session.wait(WAIT_S)  # the start-up itself went well: nothing to raise


def test_a_close_from_inside_the_teardown_returns_at_once(tmp_path: Path) -> None:
    notes: list[str] = []

    class ClosesOnUninstall(Noted):
        session: Session | None = None

        def uninstall(self) -> None:
            super().uninstall()
            assert self.session is not None
            self.session.close()
            notes.append("nested close returned")

    nested = ClosesOnUninstall("nested", notes)
    slot = CountingSlot()
    session = slot.init(pool=tmp_path / "pool", integrations=[nested])
    nested.session = session
    closer, raised = _on_thread(session.close, "closer")
    closer.join(WAIT_S)
    assert not closer.is_alive() and raised == []
    assert notes == ["install nested", "uninstall nested", "nested close returned"]
    assert slot.left == 1
