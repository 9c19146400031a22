"""Edges of ``distcache.init`` and its settings: bad values refused with their name,
a teardown that finishes whatever fails, no secret in a repr, a malformed leader's
word refused as such."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import distcache
from distcache._options import InitOptions
from distcache.artifact import Artifact
from distcache.config import settings
from distcache.errors import ConfigError, WireError
from distcache.session import SessionSlot
from tests.support.helpers import PlainIntegration, isolated_init


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


class Tracked(PlainIntegration):
    """An integration that notes its install and uninstall; its uninstall may fail."""

    def __init__(self, name: str, notes: list[str], *, fail_uninstall: bool = False,
                 fail_install: bool = False) -> None:
        self.name, self.notes, self.fail_uninstall = name, notes, fail_uninstall
        self.fail_install = fail_install

    def install(self, pool: Any, origin: Any) -> None:
        if self.fail_install:
            raise ConfigError(f"{self.name} cannot install", variable="x", value=None)
        self.notes.append(f"install {self.name}")

    def uninstall(self) -> None:
        self.notes.append(f"uninstall {self.name}")
        if self.fail_uninstall:
            raise RuntimeError(f"{self.name} cannot uninstall")


@pytest.mark.parametrize("value", [-1, 0, "soon", float("nan"), float("inf")])
def test_a_bad_explicit_timeout_is_a_config_error_naming_it(value: Any) -> None:
    with pytest.raises(ConfigError, match="timeout") as caught:
        settings({}, timeout=value)
    assert caught.value.variable == "timeout"


def test_init_refuses_a_negative_timeout(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="timeout=-1"):
        SessionSlot().init(pool=tmp_path / "pool", integrations=(), timeout=-1)


@pytest.mark.parametrize("raw", ["inf", "1e400", "-inf"])
def test_an_infinite_timeout_variable_is_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"DISTCACHE_TIMEOUT={raw!r}"):
        settings({"DISTCACHE_TIMEOUT": raw})


@pytest.mark.parametrize("raw", ["true", "yes", "2", "off"])
def test_a_peers_value_that_is_neither_0_1_nor_a_path_is_a_config_error(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"DISTCACHE_PEERS={raw!r}") as caught:
        settings({"DISTCACHE_PEERS": raw})
    assert caught.value.value == raw


def test_peers_0_and_1_with_spaces_and_a_socket_path_are_read() -> None:
    assert settings({"DISTCACHE_PEERS": " 0 "}).peers == "0"
    assert settings({"DISTCACHE_PEERS": "1\n"}).peers == "1"
    assert settings({"DISTCACHE_PEERS": "/run/pool/agent.sock"}).peers == "/run/pool/agent.sock"


def test_the_options_repr_shows_no_environment_value_nor_url_password() -> None:
    options = InitOptions(environ={"DISTCACHE_ORIGIN_TOKEN": "s3cret-token"},
                          origin="https://user:pa55word@cubins.example/x")
    shown = repr(options)
    assert "s3cret-token" not in shown and "pa55word" not in shown
    assert "cubins.example" in shown and "environ=" in shown


def test_a_second_init_with_other_options_says_they_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    slot = SessionSlot()
    first = slot.init(pool=tmp_path / "pool", integrations=())
    try:
        with caplog.at_level(logging.WARNING, logger="distcache"):
            assert slot.init(pool=tmp_path / "pool", integrations=()) is first
            assert slot.init() is first
            # The same values written otherwise: a str, a trailing "/", a list.
            assert slot.init(pool=f"{tmp_path / 'pool'}/", integrations=[]) is first
            assert not [r for r in caplog.records if "ignored" in r.getMessage()]
            assert slot.init(pool=tmp_path / "other", integrations=()) is first
        said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert len(said) == 1 and "pool" in said[0]
    finally:
        first.close()


def test_close_finishes_the_teardown_when_an_uninstall_fails(tmp_path: Path) -> None:
    notes: list[str] = []
    first, second = Tracked("first", notes), Tracked("second", notes, fail_uninstall=True)
    slot = SessionSlot()
    session = slot.init(pool=tmp_path / "pool", integrations=[first, second])  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="second cannot uninstall"):
        session.close()
    assert notes == ["install first", "install second", "uninstall second", "uninstall first"]
    assert session.closed and slot.current() is None and slot._session is None
    session.close()  # idempotent: nothing is uninstalled twice
    assert notes.count("uninstall first") == 1


def test_a_failed_start_up_raises_its_own_error_when_an_uninstall_fails_too(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    first = Tracked("first", notes, fail_uninstall=True)
    second = Tracked("second", notes, fail_install=True)
    slot = SessionSlot()
    with pytest.raises(ConfigError, match="second cannot install"):
        slot.init(pool=tmp_path / "pool", integrations=[first, second])  # type: ignore[list-item]
    assert notes == ["install first", "uninstall first"]
    assert slot.current() is None and slot._session is None


def test_a_background_failure_nobody_waited_for_is_logged_on_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    session = SessionSlot().init(pool=tmp_path / "pool", integrations=(), background=True,
                                 manifests=[[Artifact("a.bin", "0" * 64)]], timeout=30)
    session._thread.join(30)  # type: ignore[union-attr]
    assert session.ready
    with caplog.at_level(logging.WARNING, logger="distcache"):
        session.close()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("background start-up failed" in m and "a.bin" in m for m in said), said


def test_a_background_failure_that_wait_raised_is_not_logged_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    session = SessionSlot().init(pool=tmp_path / "pool", integrations=(), background=True,
                                 manifests=[[Artifact("a.bin", "0" * 64)]], timeout=30)
    with pytest.raises(ConfigError):
        session.wait(30)
    with caplog.at_level(logging.WARNING, logger="distcache"):
        session.close()
    assert not [r for r in caplog.records if "background start-up failed" in r.getMessage()]


@pytest.mark.parametrize("fields", [
    {"operation": "prefetch"},
    {"writers": [0], "downloaders": [0]},
    [("writers", (0,))],
])
def test_a_leaders_report_without_its_fields_is_a_wire_error(fields: Any) -> None:
    from distcache._delegate import _unpacked

    tree = SimpleNamespace(rank=1, size=2, backend="test", leader=0, node_id="n")
    with pytest.raises(WireError, match="malformed"):
        _unpacked(fields, "rank 1/2 (n)", tree)  # type: ignore[arg-type]


def test_background_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="background") as caught:
        distcache.init(pool=tmp_path / "pool", integrations=(), background="no")  # type: ignore[arg-type]
    assert caught.value.variable == "background"


def _report_fields(**changes: Any) -> dict[str, Any]:
    from distcache.collective import PrefetchReport

    report = PrefetchReport("prefetch", 1, 1, 1, 10, 1, 10, 10, 0, 0, 1, 2, (0,), (0,), 10,
                            {"fetch": 0.5})
    return {**report.as_dict(), **changes}


@pytest.mark.parametrize("changes", [
    {"downloads": "many"}, {"writers": ("0",)}, {"seconds": {"fetch": "slow"}},
    {"operation": None}, {"seconds": [("fetch", 0.5)]}, {"peak_bytes": 1.5},
])
def test_a_leaders_report_with_fields_of_the_wrong_type_is_a_wire_error(
    changes: dict[str, Any],
) -> None:
    from distcache._delegate import _unpacked

    tree = SimpleNamespace(rank=1, size=2, backend="test", leader=0, node_id="n")
    assert _unpacked(_report_fields(), "rank 1/2 (n)", tree).downloads == 1  # type: ignore[arg-type,union-attr]
    with pytest.raises(WireError, match="malformed"):
        _unpacked(_report_fields(**changes), "rank 1/2 (n)", tree)  # type: ignore[arg-type]


def test_the_same_manifests_written_otherwise_are_not_called_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "checksums.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    slot = SessionSlot()
    first = slot.init(pool=str(tmp_path / "pool"), manifests=["checksums.txt"],
                      integrations=[])
    try:
        with caplog.at_level(logging.WARNING, logger="distcache"):
            for manifests in (("checksums.txt",), [tmp_path / "checksums.txt"],
                              [f"{tmp_path}/./checksums.txt"]):
                assert slot.init(pool=tmp_path / "pool", manifests=manifests,
                                 integrations=()) is first
            assert not [r for r in caplog.records if "ignored" in r.getMessage()]
            assert slot.init(manifests=[tmp_path / "other.txt"]) is first
        said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert len(said) == 1 and "manifests" in said[0], said
    finally:
        first.close()
