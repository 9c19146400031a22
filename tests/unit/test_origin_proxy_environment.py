"""HTTP origins read the proxies the environment names as requests does, but not the
whole environment again for every request: the answer is kept while the variables
that name proxies are unchanged, and a change is seen at the next request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests

from distcache.artifact import Artifact
from distcache.origins import HttpOrigin, _environ
from distcache.origins._response import new_session
from distcache.testing import LoopbackOrigin, make_artifacts

URL = "http://origin.example:8080/k.cubin"
PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY", "no_proxy", "NO_PROXY", "REQUEST_METHOD",
                   "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_environ, "_answers", {})


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = _environ.get_environ_proxies

    def counting(url: str, no_proxy: str | None = None) -> dict[str, str]:
        calls.append(url)
        return real(url, no_proxy=no_proxy)

    monkeypatch.setattr(_environ, "get_environ_proxies", counting)
    return calls


def test_an_origin_reads_the_proxy_environment_once_for_many_requests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counted(monkeypatch)
    made = make_artifacts(tmp_path / "repo", 6, min_size=100, max_size=200)
    with LoopbackOrigin(tmp_path / "repo") as server:
        origin = HttpOrigin(server.url)
        got = [origin.fetch(Artifact(a.name, a.sha256)) for a in made]
    assert [len(g) for g in got] == [a.size for a in made]
    assert len(calls) == 1, calls


ENVIRONMENTS: list[dict[str, str]] = [
    {},
    {"http_proxy": "http://proxy.example:3128"},
    {"HTTP_PROXY": "http://upper.example:3128", "https_proxy": "http://tls.example:3128"},
    {"all_proxy": "socks5://all.example:1080"},
    {"http_proxy": "http://proxy.example:3128", "no_proxy": "origin.example"},
    {"http_proxy": "http://proxy.example:3128", "NO_PROXY": "*.example"},
    {"http_proxy": "http://proxy.example:3128", "no_proxy": "other.example"},
    {"http_proxy": "http://proxy.example:3128", "REQUEST_METHOD": "GET"},
    {"REQUESTS_CA_BUNDLE": "/etc/ca.pem"},
    {"CURL_CA_BUNDLE": "/etc/curl.pem"},
]


@pytest.mark.parametrize("env", ENVIRONMENTS, ids=lambda e: ",".join(e) or "none")
@pytest.mark.parametrize("url", [URL, "https://origin.example/k.cubin"])
def test_the_merge_is_what_requests_gives(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                          url: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ours, theirs = new_session(4), requests.Session()
    for proxies in ({}, {"no_proxy": "origin.example"}, {"http": "http://given.example:1"}):
        for verify in (None, True, False, "/given.pem"):
            args: tuple[Any, ...] = (url, dict(proxies), None, verify, None)
            assert ours.merge_environment_settings(*args) == theirs.merge_environment_settings(
                url, dict(proxies), None, verify, None)


def test_a_changed_proxy_variable_is_seen_at_the_next_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counted(monkeypatch)
    assert _environ.environ_proxies(URL, None) == {}
    monkeypatch.setenv("http_proxy", "http://one.example:3128")
    assert _environ.environ_proxies(URL, None)["http"] == "http://one.example:3128"
    assert _environ.environ_proxies(URL, None)["http"] == "http://one.example:3128"
    monkeypatch.setenv("http_proxy", "http://two.example:3128")
    assert _environ.environ_proxies(URL, None)["http"] == "http://two.example:3128"
    monkeypatch.setenv("no_proxy", "origin.example")
    assert _environ.environ_proxies(URL, None) == {}
    monkeypatch.delenv("no_proxy")
    monkeypatch.delenv("http_proxy")
    assert _environ.environ_proxies(URL, None) == {}
    # Read again at each change (the last is the first environment again: kept), never
    # at a repeated request.
    assert len(calls) == 4


def test_other_variables_changing_do_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counted(monkeypatch)
    monkeypatch.setenv("http_proxy", "http://one.example:3128")
    for i in range(3):
        monkeypatch.setenv("SOME_JOB_VARIABLE", str(i))
        assert _environ.environ_proxies(URL, None)["http"] == "http://one.example:3128"
    assert _environ.environ_proxies("http://elsewhere.example/k", None)["http"] == (
        "http://one.example:3128")
    assert len(calls) == 2  # once per host


def test_the_answer_handed_out_is_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://one.example:3128")
    first = _environ.environ_proxies(URL, None)
    first["http"] = "changed by a caller"
    assert _environ.environ_proxies(URL, None)["http"] == "http://one.example:3128"


def test_the_kept_answers_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(_environ._KEPT + 10):
        _environ.environ_proxies(f"http://host{i}.example/k", None)
    assert len(_environ._answers) <= _environ._KEPT
