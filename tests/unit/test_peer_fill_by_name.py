"""Concurrent peer requests share a walk or an origin download only when they ask for
the same name: the origin is asked by name, so one name's 'not at origin' is never
another name's answer for the same bytes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import BinaryIO

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ArtifactNotFound
from distcache.origins._base import BaseOrigin
from distcache.peer import derive_key, fetch, host_agent
from distcache.store import ArtifactPool

KEY = derive_key(b"n" * 32)
DATA = b"one kernel, published under two names" * 50
SHA = sha256_hex(DATA)


class _OneName(BaseOrigin):
    """Serves DATA under ``good/k`` alone, slowly, as a remote origin answers; counts
    what it is asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def describe(self) -> str:
        return "one-name"

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        self.asked.append(artifact.name)
        time.sleep(0.5)
        if artifact.name != "good/k":
            raise ArtifactNotFound(f"{artifact.name}: no such artifact", name=artifact.name,
                                   status=404)
        out.write(DATA)
        return len(DATA)


def test_a_name_the_origin_serves_is_not_answered_by_another_names_miss(tmp_path: Path) -> None:
    origin = _OneName()
    agent = host_agent(ArtifactPool(tmp_path / "pool"), lambda: origin, KEY, "node0")
    agent.join([agent.endpoint], 0)
    out: dict[str, str] = {}

    def ask(name: str) -> None:
        try:
            out[name] = fetch(agent.endpoint, KEY, Artifact(name, SHA), fill=True,
                              timeout=10).source
        except Exception as exc:  # what the asker would see
            out[name] = f"{type(exc).__name__}: {exc}"

    try:
        stale = threading.Thread(target=ask, args=("stale/k",))
        stale.start()
        time.sleep(0.1)  # the stale name's download is under way
        good = threading.Thread(target=ask, args=("good/k",))
        good.start()
        stale.join(30)
        good.join(30)
    finally:
        agent.stop()
    assert out["stale/k"].startswith("ArtifactNotFound"), out
    assert out["good/k"] == "origin", out
    assert sorted(origin.asked) == ["good/k", "stale/k"]
