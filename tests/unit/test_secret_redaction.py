"""Secrets an origin carries never show: not a URL's password or signed query, not a
header the caller passed, not the peer tier's request key. Each place that names an
origin or a request is asked: the doctor report, an error and its ``value``, a log
line, a ``repr``, and the headers a host a redirect points to receives."""

from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from distcache._options import InitOptions
from distcache._urls import redact_url
from distcache.artifact import Artifact
from distcache.config import settings
from distcache.errors import ConfigError, OriginError
from distcache.integrations.flashinfer._download import RoutedDownload
from distcache.origins import Credentials, HttpOrigin, open_origin
from distcache.peer import Tier
from distcache.testing import LoopbackOrigin
from tests.support.cli import cli_env, run_cli
from tests.support.helpers import clear_settings

SECRETS = ("SECRET123", "SIGSECRET", "RET123")
ORIGIN = "https://alice:SECRET123@mirror.example/cubins?sig=SIGSECRET"


def _shown(exc: BaseException) -> str:
    """Everything an error shows: its text, its repr, its attributes (``value``,
    ``url``) and the traceback with every cause."""
    return "\n".join([str(exc), repr(exc), repr(vars(exc)), *traceback.format_exception(exc)])


def _assert_hidden(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


# -- the doctor report ---------------------------------------------------------------


@pytest.mark.parametrize("json_output", [False, True])
def test_doctor_shows_each_origin_without_its_password_or_query(
    tmp_path: Path, json_output: bool
) -> None:
    env = cli_env(tmp_path)
    env["DISTCACHE_ORIGIN"] = f"{ORIGIN},{tmp_path / 'mirror'}"
    done = run_cli(env, "--pool", str(tmp_path / "pool"), "doctor",
                   *(["--json"] if json_output else []))
    assert done.returncode == 0, done.stderr
    _assert_hidden(done.stdout + done.stderr)
    origins = (json.loads(done.stdout)["origins"] if json_output else
               next(line for line in done.stdout.splitlines() if line.startswith("origins:")))
    assert f"https://mirror.example/cubins, {tmp_path / 'mirror'}" in origins


# -- headers the caller passed ---------------------------------------------------------

CALLER_HEADERS = {"X-Api-Key": "APIKEYSECRET123", "Private-Token": "PTSECRET123"}


def test_caller_headers_go_to_the_origins_own_host_only(
    origin_server: LoopbackOrigin, artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    with LoopbackOrigin(artifact_dir, host="127.0.0.2") as other:
        origin = HttpOrigin(origin_server.url, token="SECRET123", headers=CALLER_HEADERS,
                            allow_redirect_hosts=["127.0.0.2"], retries=0)
        origin_server.inject("redirect", base=other.url)
        origin.fetch(artifacts[0])
        sent = origin_server.last_headers
        assert (sent["x-api-key"], sent["private-token"]) == ("APIKEYSECRET123", "PTSECRET123")
        assert sent["authorization"] == "Bearer SECRET123"
        received = other.last_headers
        assert other.total_requests == 1
        assert not {"x-api-key", "private-token", "authorization"} & set(received), received
        # What every host needs still goes: the body length is checked unencoded.
        assert received["accept-encoding"] == "identity"
        assert received["user-agent"].startswith("distcache/")


def test_a_caller_header_the_http_stack_refuses_is_not_quoted(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    # requests refuses a value with a newline and quotes it in its exception. (Built at
    # run time: no source line a traceback quotes holds it.)
    key = "".join(("APIKEY", "SECRET123"))
    origin = HttpOrigin(origin_server.url, headers={"X-Api-Key": key + "\n"}, retries=0)
    with pytest.raises(OriginError) as info:
        origin.fetch(artifacts[0])
    assert key not in _shown(info.value)
    assert "<redacted>" in str(info.value)


# -- an origin written without its scheme ------------------------------------------------


@pytest.mark.parametrize(("spec", "shown"), [
    ("alice:SECRET123@mirror.example/cubins", "mirror.example/cubins"),
    ("mirror.example/cubins?token=SECRET123", "mirror.example/cubins"),
    ("alice:SECRET123@mirror.example/cubins?next=https://cdn.example", "mirror.example/cubins"),
])
def test_an_origin_without_a_scheme_is_named_without_its_secrets(
    spec: str, shown: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no scheme") as info:
        open_origin(spec, credentials=Credentials.none())
    _assert_hidden(_shown(info.value))
    assert info.value.value == shown  # type: ignore[attr-defined]
    assert f"write http://{shown} or https://{shown}" in str(info.value)


# -- FlashInfer's download, refused offline -------------------------------------------


def test_an_offline_refusal_logs_the_url_without_its_secrets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The loader is never asked: only an installed (not retired) one is looked at.
    loader = SimpleNamespace(retired=False)
    routed = RoutedDownload(loader=loader, original=lambda *a, **k: True,  # type: ignore[arg-type]
                            offline=True)
    caplog.set_level(logging.DEBUG)
    # As get_artifact's own download calls it (with the digest): never routed.
    url = "https://alice:SECRET123@mirror.example/cubins/x.cubin?sig=SIGSECRET"
    assert routed(url, str(tmp_path / "x.cubin"), expected_sha256="0" * 64) is False
    text = "\n".join(r.getMessage() for r in caplog.records)
    _assert_hidden(text)
    assert "https://mirror.example/cubins/x.cubin" in text and "DISTCACHE_OFFLINE" in text


# -- reprs ---------------------------------------------------------------------------


def test_the_peer_tiers_repr_hides_its_request_key() -> None:
    tier = Tier("unix:/run/agent.sock", b"SECRET123-0123456789abcdef012345")
    for text in (repr(tier), str(tier), f"{tier}", repr([tier])):
        assert "SECRET123" not in text and "key" not in text, text
        assert "unix:/run/agent.sock" in text


ORIGIN_SPECS = [
    "https://alice:SECRET123@mirror.example/c",
    "https://ghp_SECRET123@mirror.example/c",
    "https://mirror.example/c?token=SECRET123",
    "https://alice:p@ss/SECRET123@mirror.example/c",
    "https://alice:SEC/RET123@mirror.example/c",
]


@pytest.mark.parametrize("origin", [
    *ORIGIN_SPECS,
    ",".join(ORIGIN_SPECS),
    ORIGIN_SPECS,
    tuple(ORIGIN_SPECS),
])
def test_init_options_repr_shows_origins_without_their_secrets(origin: Any) -> None:
    text = repr(InitOptions(origin=origin))
    _assert_hidden(text)
    # Where a password and an '@' further on cannot be told apart from an '@' in the
    # path, only the scheme is shown.
    assert "mirror.example/c" in text or text.count("https://...") == 1


def test_an_origin_list_with_spaces_is_shown_without_its_passwords() -> None:
    text = repr(InitOptions(origin="https://m/c, https://alice:SECRET123@mirror.example/c"))
    _assert_hidden(text)
    assert "https://mirror.example/c" in text


@pytest.mark.parametrize("url", [
    "https://u:SECRET123@registry.example/api/npm/@scope/pkg",
    "https://u:SECRET123@mirror.example/c?a=b@evil.example",
])
def test_a_password_and_an_at_sign_further_on_show_no_other_host(url: str) -> None:
    # Not "https://...@scope/pkg" or "https://...@evil.example": hosts never asked.
    assert redact_url(url) == "https://..."


def test_settings_repr_shows_origins_without_their_secrets() -> None:
    conf = settings({"DISTCACHE_ORIGIN": ",".join(ORIGIN_SPECS),
                     "DISTCACHE_ORIGIN_TOKEN": "TOKSECRET123"})
    text = repr(conf)
    _assert_hidden(text)
    assert "TOKSECRET123" not in text
    assert "origins=('https://mirror.example/c'," in text
    assert conf.origins[0] == ORIGIN_SPECS[0]  # the value itself is untouched


# -- redact_url ----------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "https://alice:SEC/RET123@mirror.example/c",
    "https://alice:SEC?RET123@mirror.example/c",
    "https://alice:99999/RET123@mirror.example/c",
])
def test_a_password_holding_a_slash_is_hidden_whole(url: str) -> None:
    assert redact_url(url) == "https://...@mirror.example/c"


def test_a_url_whose_password_holds_a_slash_is_refused_without_it() -> None:
    url = "https://alice:SEC/RET123@mirror.example/c"
    for refuse in (lambda: HttpOrigin(url),
                   lambda: open_origin(url, credentials=Credentials.none())):
        with pytest.raises(ConfigError, match="not a valid URL") as info:
            refuse()
        _assert_hidden(_shown(info.value))
        assert "mirror.example/c" in str(info.value)


@pytest.mark.parametrize("url", [
    "https://mirror.example/pkg@1.0/k.cubin",
    "https://mirror.example:8443/pkg@1.0/k.cubin",
    "http://[::1]:8000/pkg@1.0/k.cubin",
    "/srv/mirror/pkg@1.0",
])
def test_an_at_sign_in_an_ordinary_path_stays_readable(url: str) -> None:
    assert redact_url(url) == url
    assert redact_url(f"{url}?sig=x") == url
