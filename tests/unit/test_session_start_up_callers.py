"""Calls a session's own start-up makes on it, and a fork after it, and a second
``init`` with a bad argument.

* An install (a library the engine embeds) that calls ``init()``, gets the session
  being started and calls ``wait()`` or ``sync()`` on it, as a background ``init``'s
  callers are told to, waited for its own start-up: for ever, and a ``close`` then
  waited for ever too. It now returns at once, as in a foreground start-up.
* An install beside the prefetch of a foreground ``init`` that gives up and closes
  the session it gets deadlocked: its close waited for the slot's lock, which the
  ``init`` waiting for the install held. ``init`` now raises that the session was
  closed during its start-up.
* A child forked after the background start-up was over was told the start-up had
  been forked while it ran (``ready`` and ``wait`` raised); it now has its outcome.
* A second ``init`` given a wrong positional argument raised ``AttributeError`` from
  the check for ignored options; it now raises the first call's ``ConfigError``.
* ``jit_caches`` that is not a list of names, and ``ipc_pools`` items that are not
  producer pools, got past the checks and failed with a raw ``TypeError`` or
  ``AttributeError`` once the communicator and the pool were set up; they are now a
  ``ConfigError`` naming the field before anything is set up.

Every wait is bounded, so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import select
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.errors import ConfigError, DistcacheError
from distcache.session import Session, SessionSlot
from tests.support.helpers import isolated_init, on_threads
from tests.unit.test_session_close import Noted

WAIT_S = 30.0


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


class CallsBack(Noted):
    """An integration whose install calls ``init()`` on ``slot`` and then ``call`` on
    the session that gives (``wait`` or ``sync``); what it got is kept."""

    def __init__(self, slot: SessionSlot, call: str, notes: list[str]) -> None:
        super().__init__("calls-back", notes)
        self.slot, self.call = slot, call
        self.got: list[Any] = []

    def install(self, pool: Any, origin: Any) -> None:
        session = self.slot.init()
        self.got.append(session)
        self.got.append(getattr(session, self.call)())
        super().install(pool, origin)


@pytest.mark.parametrize("call", ["wait", "sync"])
@pytest.mark.parametrize("background", [True, False])
def test_the_start_up_waiting_on_its_own_session_returns_at_once(
    tmp_path: Path, call: str, background: bool,
) -> None:
    slot = SessionSlot()
    notes: list[str] = []
    calls = CallsBack(slot, call, notes)

    def run(rank: int) -> list[str]:
        session = slot.init(pool=tmp_path / "pool", integrations=[calls],
                            background=background, timeout=WAIT_S)
        try:
            session.wait(WAIT_S)
            assert calls.got[:1] == [session]
        finally:
            session.close()
        return notes

    [result] = on_threads(1, run, join=2 * WAIT_S)
    assert result == ["install calls-back", "uninstall calls-back"], result
    assert slot.current() is None


def test_a_child_forked_after_the_start_up_has_its_outcome(tmp_path: Path) -> None:
    session = SessionSlot().init(pool=tmp_path / "pool", integrations=[Noted("n", [])],
                                 background=True, timeout=WAIT_S)
    try:
        report = session.wait(WAIT_S)
        assert session.ready
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running any of pytest's
            try:
                said: dict[str, str] = {}
                for what, call in (("ready", lambda: session.ready),
                                   ("wait", lambda: session.wait(5) is report)):
                    try:
                        said[what] = f"returned {call()!r}"
                    except BaseException as exc:
                        said[what] = f"{type(exc).__name__}: {exc}"
                os.write(write, json.dumps(said).encode())
            finally:
                os._exit(0)
        os.close(write)
        try:
            ready, _, _ = select.select([read], [], [], WAIT_S)
            answer = json.loads(os.read(read, 65536).decode()) if ready else None
        finally:
            os.close(read)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert answer == {"ready": "returned True", "wait": "returned True"}, answer
    finally:
        session.close()


@pytest.mark.parametrize("bad", [{"manifests": []}, "manifests", 5])
def test_a_second_init_with_a_bad_positional_argument_is_a_config_error(
    tmp_path: Path, bad: Any,
) -> None:
    slot = SessionSlot()
    with pytest.raises(ConfigError, match="positional argument") as first:
        slot.init(bad)
    session: Session = slot.init(pool=tmp_path / "pool", integrations=[], timeout=WAIT_S)
    try:
        with pytest.raises(ConfigError, match="positional argument") as again:
            slot.init(bad)
        assert str(again.value) == str(first.value)
        assert slot.current() is session and not session.closed
    finally:
        session.close()


@pytest.mark.parametrize(("field", "value", "said"), [
    ("jit_caches", 5, "not 5"),
    ("jit_caches", "inductor", "not the string 'inductor'"),
    ("jit_caches", ["inductor", 7], "not 7"),
    ("ipc_pools", [5], "not 5"),
    ("ipc_pools", ["features"], "not 'features'"),
])
def test_a_field_of_the_wrong_shape_is_refused_before_anything_is_set_up(
    tmp_path: Path, field: str, value: Any, said: str,
) -> None:
    slot = SessionSlot()
    with pytest.raises(ConfigError, match=field) as caught:
        slot.init(pool=tmp_path / "pool", integrations=[], timeout=WAIT_S, **{field: value})
    assert said in str(caught.value)
    assert caught.value.variable == field  # type: ignore[attr-defined]
    assert not (tmp_path / "pool").exists()  # refused before the pool was set up
    assert slot.current() is None


class GivesUp(Noted):
    """An integration installed beside the prefetch whose install closes the session
    that ``init()`` on ``slot`` gives it (the one being started)."""

    install_beside_prefetch = True

    def __init__(self, slot: SessionSlot, notes: list[str]) -> None:
        super().__init__("gives-up", notes)
        self.slot = slot

    def install(self, pool: Any, origin: Any) -> None:
        super().install(pool, origin)
        self.slot.init().close()


def test_an_install_beside_the_prefetch_closing_its_session_fails_init(
    tmp_path: Path,
) -> None:
    slot = SessionSlot()
    notes: list[str] = []
    [raised] = on_threads(1, lambda rank: slot.init(
        pool=tmp_path / "pool", integrations=[GivesUp(slot, notes)], timeout=WAIT_S),
        join=2 * WAIT_S)
    assert isinstance(raised, DistcacheError), raised
    assert "closed during its start-up" in str(raised)
    assert notes == ["install gives-up", "uninstall gives-up"]
    assert slot.current() is None
