"""The pool and the HTTP origin a start-up builds take their settings from the mapping
``init(environ=...)`` was given, not from the process's environment; and a pool or an
HTTP origin reads only the variables it uses, so a bad unrelated one cannot stop it,
while its own keywords are still checked as ``settings()`` checks them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcache
from distcache._resolve import resolve_origin, resolve_pool
from distcache.comm import LocalCommunicator
from distcache.config import settings
from distcache.errors import ConfigError
from distcache.origins import OriginChain
from distcache.origins._http import HttpOrigin
from distcache.store import ArtifactPool
from tests.support.helpers import isolated_init

URL = "https://mirror.invalid/cubins"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[HttpOrigin]:
    """Every HttpOrigin made while the test runs."""
    out: list[HttpOrigin] = []
    real = HttpOrigin.__init__

    def record(self: HttpOrigin, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        out.append(self)

    monkeypatch.setattr(HttpOrigin, "__init__", record)
    return out


def _process(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(f"DISTCACHE_{name}", value)


def _http(origin: object) -> list[tuple[float, int, int]]:
    origins = origin.origins if isinstance(origin, OriginChain) else (origin,)
    return [(o.timeout, o.retries, o.max_bytes) for o in origins]  # type: ignore[attr-defined]


# --- through the resolvers ----------------------------------------------------------------


def test_resolve_pool_caps_and_waits_as_the_settings_given_say(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _process(monkeypatch, POOL_MAX_BYTES="1k", LOCK_TIMEOUT="5")
    conf = settings({"DISTCACHE_LOCK_TIMEOUT": "7"})
    pool = resolve_pool(tmp_path / "pool", conf)
    assert (pool.max_bytes, pool.lock_timeout) == (None, 7.0)
    pool = resolve_pool(tmp_path / "pool", settings({"DISTCACHE_POOL_MAX_BYTES": "2k"}))
    assert (pool.max_bytes, pool.lock_timeout) == (2048, 120.0)


def test_resolve_pool_is_not_stopped_by_a_bad_process_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _process(monkeypatch, HTTP_RETRIES="many", POOL_MAX_BYTES="lots", LOCK_TIMEOUT="soon")
    pool = resolve_pool(tmp_path / "pool", settings({}))
    assert (pool.max_bytes, pool.lock_timeout) == (None, 120.0)


@pytest.mark.parametrize("given", [URL, None])
def test_resolve_origin_times_and_retries_as_the_settings_given_say(
    monkeypatch: pytest.MonkeyPatch, given: str | None
) -> None:
    _process(monkeypatch, HTTP_TIMEOUT="1", HTTP_RETRIES="9", MAX_ARTIFACT_BYTES="1k")
    environ = {"DISTCACHE_HTTP_RETRIES": "2"}
    if given is None:
        environ["DISTCACHE_ORIGIN"] = f"{URL},https://other.invalid"
    origin = resolve_origin(given, settings(environ))
    expected = (30.0, 2, 4 << 30)
    assert _http(origin) == [expected] * (1 if given else 2)


def test_resolve_origin_is_not_stopped_by_a_bad_process_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _process(monkeypatch, HTTP_TIMEOUT="never", HTTP_RETRIES="many", POOL_MAX_BYTES="lots")
    origin = resolve_origin(URL, settings({"DISTCACHE_HTTP_TIMEOUT": "3"}))
    assert _http(origin) == [(3.0, 4, 4 << 30)]


def test_the_process_settings_still_hold_outside_a_resolver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _process(monkeypatch, POOL_MAX_BYTES="1k", LOCK_TIMEOUT="5", HTTP_TIMEOUT="1",
             HTTP_RETRIES="9", MAX_ARTIFACT_BYTES="2k")
    resolve_origin(URL, settings({}))  # leaves no setting behind
    pool = ArtifactPool(tmp_path / "pool")
    assert (pool.max_bytes, pool.lock_timeout) == (1024, 5.0)
    assert _http(HttpOrigin(URL)) == [(1.0, 9, 2048)]
    pool = resolve_pool(tmp_path / "pool", settings())
    assert (pool.max_bytes, pool.lock_timeout) == (1024, 5.0)


# --- a pool or an origin reads only its own variables -------------------------------------


def test_a_pool_reads_only_its_own_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _process(monkeypatch, HTTP_RETRIES="many", CHUNK_BYTES="0", TRANSPORT="pigeon")
    pool = ArtifactPool(tmp_path / "pool")
    assert (pool.max_bytes, pool.lock_timeout) == (None, 120.0)
    _process(monkeypatch, POOL_MAX_BYTES="lots")
    with pytest.raises(ConfigError, match="DISTCACHE_POOL_MAX_BYTES"):
        ArtifactPool(tmp_path / "pool")
    assert ArtifactPool(tmp_path / "pool", max_bytes=10).max_bytes == 10


def test_an_http_origin_reads_only_its_own_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    _process(monkeypatch, LOCK_TIMEOUT="soon", POOL_MAX_BYTES="lots", CHUNK_BYTES="0")
    assert _http(HttpOrigin(URL)) == [(30.0, 4, 4 << 30)]
    _process(monkeypatch, HTTP_RETRIES="many")
    with pytest.raises(ConfigError, match="DISTCACHE_HTTP_RETRIES"):
        HttpOrigin(URL)
    assert HttpOrigin(URL, retries=3).retries == 3


@pytest.mark.parametrize("keywords", [{"retries": 10**7}, {"timeout": 0},
                                      {"timeout": float("nan")}, {"max_bytes": 0}])
def test_an_http_origins_keywords_are_still_checked(keywords: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HttpOrigin(URL, **keywords)


@pytest.mark.parametrize("keywords", [{"retries": 10**7}, {"timeout": 0}, {"max_bytes": 0}])
def test_an_http_origins_keywords_are_checked_whatever_the_defaults(
    keywords: dict[str, Any],
) -> None:
    with pytest.raises(ConfigError):
        HttpOrigin(URL, **keywords, defaults=settings({}))
    with pytest.raises(ConfigError):
        HttpOrigin(URL, **keywords, defaults={})


@pytest.mark.parametrize("keywords", [{"max_bytes": -1}, {"lock_timeout": -1.0}])
def test_a_pools_keywords_are_still_checked(tmp_path: Path, keywords: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(keywords))):
        ArtifactPool(tmp_path / "pool", **keywords)


def test_a_pool_takes_its_defaults_from_settings_or_a_mapping(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool", lock_timeout=0, defaults=settings({}))
    assert (pool.max_bytes, pool.lock_timeout) == (None, 0)
    pool = ArtifactPool(tmp_path / "pool", defaults={"DISTCACHE_POOL_MAX_BYTES": "1k"})
    assert (pool.max_bytes, pool.lock_timeout) == (1024, 120.0)


def test_keywords_win_over_the_defaults_given(tmp_path: Path) -> None:
    conf = settings({"DISTCACHE_POOL_MAX_BYTES": "1k", "DISTCACHE_HTTP_RETRIES": "1"})
    pool = ArtifactPool(tmp_path / "pool", max_bytes=4096, defaults=conf)
    assert (pool.max_bytes, pool.lock_timeout) == (4096, 120.0)
    assert _http(HttpOrigin(URL, timeout=2, defaults=conf)) == [(2.0, 1, 4 << 30)]


# --- through init(environ=...) ------------------------------------------------------------


def _init(tmp_path: Path, environ: dict[str, str]) -> distcache.Session:
    return distcache.init(comm=LocalCommunicator(), pool=tmp_path / "pool", origin=URL,
                          integrations=(), environ={"DISTCACHE_PEERS": "0", **environ})


def test_init_builds_its_pool_and_origin_from_the_environ_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, made: list[HttpOrigin]
) -> None:
    _process(monkeypatch, POOL_MAX_BYTES="1k", LOCK_TIMEOUT="5", HTTP_TIMEOUT="1",
             HTTP_RETRIES="9")
    session = _init(tmp_path, {"DISTCACHE_LOCK_TIMEOUT": "7", "DISTCACHE_HTTP_RETRIES": "2"})
    try:
        assert session.pool is not None
        assert (session.pool.max_bytes, session.pool.lock_timeout) == (None, 7.0)
        assert _http(made[0]) == [(30.0, 2, 4 << 30)]
    finally:
        session.close()


def test_init_is_not_stopped_by_a_bad_process_variable_the_environ_leaves_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, made: list[HttpOrigin]
) -> None:
    _process(monkeypatch, HTTP_RETRIES="many", HTTP_TIMEOUT="never", POOL_MAX_BYTES="lots",
             LOCK_TIMEOUT="soon", MAX_ARTIFACT_BYTES="huge")
    session = _init(tmp_path, {"DISTCACHE_POOL_MAX_BYTES": "3k"})
    try:
        assert session.pool is not None
        assert (session.pool.max_bytes, session.pool.lock_timeout) == (3072, 120.0)
        assert _http(made[0]) == [(30.0, 4, 4 << 30)]
    finally:
        session.close()
