"""The public collectives and Session.wait refuse arguments of the wrong kind with a
ConfigError naming the argument and what to pass, before any round, instead of an
AttributeError from inside (or, for a missing origin, from the fetch phase)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcache
from distcache.comm import local
from distcache.errors import ConfigError, PrefetchError
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.helpers import isolated_init


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


@pytest.fixture
def given(tmp_path: Path) -> dict[str, Any]:
    artifacts = make_artifacts(tmp_path / "origin", 2)
    return {"artifacts": artifacts, "comm": local(), "pool": ArtifactPool(tmp_path / "pool"),
            "origin": DirOrigin(tmp_path / "origin")}


@pytest.mark.parametrize(("name", "value", "said"), [
    ("artifacts", "checksums.txt", "is a path, not a list of Artifacts"),
    ("artifacts", Path("checksums.txt"), "is a path, not a list of Artifacts"),
    ("artifacts", [None], "artifacts[0]=None is not an Artifact"),
    ("artifacts", 5, "is not a list of Artifacts"),
    ("pool", "/tmp/pool", "is not an ArtifactPool"),
    ("origin", "/tmp/origin", "is not an origin"),
    ("comm", None, "is not a distcache communicator"),
])
def test_prefetch_refuses_an_argument_of_the_wrong_kind_naming_it(
        given: dict[str, Any], name: str, value: Any, said: str) -> None:
    args = {**given, name: value}
    artifacts = args.pop("artifacts")
    with pytest.raises(ConfigError, match=f"prefetch's {name}") as raised:
        distcache.prefetch(artifacts, **args)
    assert said in str(raised.value)


def test_prefetch_without_an_origin_names_what_no_pool_holds(given: dict[str, Any]) -> None:
    with pytest.raises(PrefetchError, match="given no origin"):
        distcache.prefetch(given["artifacts"], comm=given["comm"], pool=given["pool"],
                           origin=None)


def test_prefetch_without_an_origin_moves_what_the_pools_hold(given: dict[str, Any]) -> None:
    distcache.prefetch(given["artifacts"], comm=given["comm"], pool=given["pool"],
                       origin=given["origin"])
    report = distcache.prefetch(given["artifacts"], comm=given["comm"], pool=given["pool"],
                                origin=None)
    assert report.downloads == 0


@pytest.mark.parametrize(("name", "value", "said"), [
    ("pool", "/tmp/pool", "sync's pool"),
    ("state", 1, "sync's state=1 is not a SyncState"),
])
def test_sync_refuses_an_argument_of_the_wrong_kind_naming_it(
        given: dict[str, Any], name: str, value: Any, said: str) -> None:
    args = {"comm": given["comm"], "pool": given["pool"], name: value}
    with pytest.raises(ConfigError, match=said):
        distcache.sync(**args)


@pytest.mark.parametrize("timeout", ["x", math.nan, -1, True])
def test_session_wait_refuses_a_timeout_that_is_no_duration(
        given: dict[str, Any], tmp_path: Path, timeout: Any) -> None:
    manifest = tmp_path / "checksums.txt"
    manifest.write_text("".join(f"{a.sha256}  {a.name}\n" for a in given["artifacts"]))
    session = distcache.init(manifests=[str(manifest)], pool=str(tmp_path / "pool"),
                             origin=str(tmp_path / "origin"), background=True,
                             integrations=[])
    try:
        with pytest.raises(ConfigError, match="wait's timeout"):
            session.wait(timeout=timeout)
        for fine in (math.inf, 1e12, 600):  # no limit, or a long one: waits, never raises
            assert session.wait(timeout=fine) is not None
    finally:
        session.close()
