"""The events file is written only when it is a regular file of this user, and never
hangs the job; the default pool directory comes only from absolute directories and
is worked out only where the pool is not given; ``-vv`` shows the HTTP library's
connection lines without the secrets a URL carries."""

from __future__ import annotations

import io
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from distcache import _events
from distcache._logging import configure_logging
from distcache.config import settings
from distcache.errors import ConfigError
from tests.support.cli import REPO
from tests.support.process import run_group

# --- DISTCACHE_LOG_JSON ---------------------------------------------------------------


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "DISTCACHE_LOG_JSON" in r.getMessage()]


def test_a_fifo_without_a_reader_drops_the_event_instead_of_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "DISTCACHE_LOG_JSON": str(fifo), "PYTHONPATH": str(REPO)}
    code = "import sys; from distcache import _events; sys.exit(3 if _events.emit('x') else 0)"
    try:
        done = run_group([sys.executable, "-c", code], timeout=30, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("emit() blocked on a FIFO that nobody reads")
    assert done.returncode == 0, done.stderr
    assert "DISTCACHE_LOG_JSON" in done.stderr


def test_a_fifo_with_a_reader_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        monkeypatch.setenv("DISTCACHE_LOG_JSON", str(fifo))
        _events._warned.clear()
        assert _events.emit("x") is False
        assert os.read(reader, 100) == b""  # no writer left, nothing written
    finally:
        os.close(reader)
    assert len(_warnings(caplog)) == 1


def test_a_symbolic_link_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    victim = tmp_path / "victim"
    victim.write_text("original\n")
    (tmp_path / "link").symlink_to(victim)
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(tmp_path / "link"))
    _events._warned.clear()
    assert _events.emit("x") is False
    assert _events.emit("y") is False
    assert victim.read_text() == "original\n"
    assert len(_warnings(caplog)) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_file_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    theirs = tmp_path / "events.jsonl"
    theirs.write_text("")
    os.chown(theirs, 54321, 54321)
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(theirs))
    _events._warned.clear()
    assert _events.emit("x") is False
    assert theirs.read_text() == ""
    assert len(_warnings(caplog)) == 1


def test_a_created_events_file_is_private_and_an_own_file_is_appended_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(target))
    old = os.umask(0)
    try:
        assert _events.emit("x") is True
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    target.chmod(0o644)  # an existing file keeps the mode its owner gave it
    assert _events.emit("y") is True
    assert len(target.read_text().splitlines()) == 2
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


# --- the default pool directory -------------------------------------------------------


@pytest.fixture()
def no_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HOME, no XDG_CACHE_HOME, no DISTCACHE_POOL, and no password database entry."""
    for name in ("HOME", "XDG_CACHE_HOME", "DISTCACHE_POOL"):
        monkeypatch.delenv(name, raising=False)

    def missing(uid: int) -> object:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr("pwd.getpwuid", missing)


def test_without_a_home_the_settings_resolve_and_only_the_pool_raises(
        no_home: None, tmp_path: Path) -> None:
    conf = settings()
    assert conf.timeout == 600.0
    with pytest.raises(ConfigError, match="DISTCACHE_POOL") as caught:
        _ = conf.pool_dir
    assert "HOME" in str(caught.value) and caught.value.variable == "DISTCACHE_POOL"
    assert settings(pool_dir=tmp_path).pool_dir == tmp_path
    assert settings({"DISTCACHE_POOL": str(tmp_path)}).pool_dir == tmp_path
    assert conf.replace(pool_dir=tmp_path).pool_dir == tmp_path


def test_without_a_home_a_command_given_the_pool_runs(
        no_home: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from distcache.cli import main
    from distcache.store import ArtifactPool

    ArtifactPool(tmp_path / "pool")
    assert main(["--pool", str(tmp_path / "pool"), "pool", "ls"]) == 0
    assert "internal error" not in capsys.readouterr().err


def test_without_a_home_a_command_needing_the_default_pool_names_the_variables(
        no_home: None, capsys: pytest.CaptureFixture[str]) -> None:
    from distcache.cli import main

    assert main(["pool", "ls"]) != 0
    err = capsys.readouterr().err
    assert "internal error" not in err
    assert "DISTCACHE_POOL" in err and "HOME" in err


def test_an_empty_or_relative_home_or_xdg_cache_home_counts_as_unset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Account:
        pw_dir = "/account"

    monkeypatch.setattr("pwd.getpwuid", lambda uid: Account())
    monkeypatch.delenv("HOME", raising=False)
    assert settings({"HOME": ""}).pool_dir == Path("/account/.cache/distcache")
    assert settings({"HOME": "rel"}).pool_dir == Path("/account/.cache/distcache")
    assert settings({"XDG_CACHE_HOME": "relcache", "HOME": "/h"}).pool_dir == Path(
        "/h/.cache/distcache")
    assert settings({"XDG_CACHE_HOME": "", "HOME": "/h"}).pool_dir == Path("/h/.cache/distcache")
    assert settings({"XDG_CACHE_HOME": "/x"}).pool_dir == Path("/x/distcache")


def test_an_empty_home_and_no_account_is_an_error_not_the_current_directory(
        no_home: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for environ in ({"HOME": ""}, {"HOME": "rel", "XDG_CACHE_HOME": "relcache"}):
        with pytest.raises(ConfigError, match="DISTCACHE_POOL"):
            _ = settings(environ).pool_dir
    assert list(tmp_path.iterdir()) == []


# --- -vv ------------------------------------------------------------------------------


def test_vv_shows_connection_lines_without_queries_or_user_info() -> None:
    stream = io.StringIO()
    restore = configure_logging(2, None, stream=stream)
    try:
        pool_log = logging.getLogger("urllib3.connectionpool")
        pool_log.debug("Starting new HTTP connection (%d): %s:%s", 1, "mirror", 8080)
        pool_log.debug('%s://%s:%s "%s %s %s" %s %s', "http", "mirror", 8080, "GET",
                       "/sub/f.bin?sig=QUERYSECRET", "HTTP/1.1", 200, 10)
        logging.getLogger("urllib3.util.retry").debug(
            "Incremented Retry for (url='%s'): %r", "/f?token=QUERYSECRET", "Retry(total=3)")
        pool_log.debug("Redirecting %s -> %s", "http://alice:PWSECRET@mirror/a?x=QUERYSECRET",
                       "https://cdn/b?sig=QUERYSECRET#frag")
    finally:
        restore()
    shown = stream.getvalue()
    assert "Starting new HTTP connection (1): mirror:8080" in shown
    assert "GET /sub/f.bin" in shown and "200" in shown
    assert "Redirecting http://mirror/a" in shown and "https://cdn/b" in shown
    assert "SECRET" not in shown
    assert len(shown.splitlines()) == 4


def test_without_vv_connection_lines_stay_hidden() -> None:
    stream = io.StringIO()
    restore = configure_logging(1, None, stream=stream)
    try:
        logging.getLogger("urllib3.connectionpool").debug("Starting new HTTP connection")
    finally:
        restore()
    assert stream.getvalue() == ""
