"""A child forked while a background start-up runs, in a job whose node leaders host
node agents, may close the session it inherited: the close returns at once and
uninstalls the child's integrations, and leaves the parent's node agents, whose
threads the child does not have, to the parent (which still closes them)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.comm import ThreadGroup
from distcache.session import Session, SessionSlot
from tests.support.helpers import isolated_init, on_threads
from tests.unit.test_session_lifecycle_edges import Held

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0  # what any wait of a test allows before it fails


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


def _in_child(session: Session, notes: list[str]) -> dict[str, Any]:
    """What ``close`` of ``session`` does in a forked child."""
    try:
        session.close()
        said = "returned"
    except BaseException as exc:
        said = f"{type(exc).__name__}: {exc}"
    return {"close": said, "closed": session.closed, "notes": notes}


def test_a_child_forked_during_the_start_up_closes_without_the_parents_agents(
        tmp_path: Path) -> None:
    group = ThreadGroup(2, ["node-a", "node-b"], timeout=WAIT_S)
    notes: list[list[str]] = [[], []]
    held = [Held("held", notes[0]), Held("held", notes[1])]
    sessions = on_threads(2, lambda rank: SessionSlot().init(
        comm=group.comm(rank), pool=tmp_path / f"pool-{rank}", integrations=[held[rank]],
        background=True, timeout=WAIT_S), join=WAIT_S)
    try:
        assert all(isinstance(s, Session) for s in sessions), sessions
        assert all(h.installing.wait(WAIT_S) for h in held)
        agent = sessions[0]._peers and sessions[0]._peers.agent
        assert agent is not None, "no node agent: the case is not the one tested"
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running any of pytest's
            try:
                os.write(write, json.dumps(_in_child(sessions[0], notes[0])).encode())
            finally:
                os._exit(0)
        os.close(write)
        try:
            ready, _, _ = select.select([read], [], [], 10)
            said = json.loads(os.read(read, 65536).decode()) if ready else None
        finally:
            os.close(read)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert said is not None, "the child's close did not return"
        assert said == {"close": "returned", "closed": True, "notes": []}, said
        # The parent's start-up and agent are untouched; its own close stops the agent.
        assert not agent.stopped and not sessions[0].closed
        for h in held:
            h.release.set()
        on_threads(2, lambda rank: sessions[rank].wait(WAIT_S), join=WAIT_S)
        on_threads(2, lambda rank: sessions[rank].close(), join=WAIT_S)
        assert agent.stopped and notes[0] == ["install held", "uninstall held"]
    finally:
        for h in held:
            h.release.set()
        for s in sessions:
            if isinstance(s, Session):
                with contextlib.suppress(Exception):
                    s.close()
