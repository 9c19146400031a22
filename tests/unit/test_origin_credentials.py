"""A bearer token belongs to one host: never the next origin of a chain, never an
integration's default origin, never a host a redirect points to, never shown.

The scenario throughout: ``DISTCACHE_ORIGIN=mirror,cdn`` with a token, both real
loopback servers, the mirror lacking some artifacts. The CDN must never see an
``Authorization`` header, whichever path fetches: the library, a prefetch, the CLI
and the FlashInfer wrapper.
"""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcache
from distcache import cli
from distcache._resolve import resolve_origin
from distcache.artifact import Artifact, manifest_text, sha256_hex
from distcache.comm import LocalCommunicator
from distcache.config import settings
from distcache.errors import ConfigError, DistcacheError, OriginError
from distcache.integrations import flashinfer as fi
from distcache.origins import Credentials, HttpOrigin, OriginChain, open_origin
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin

TOKEN = "tok-mirror-4b1d2c3e5f60718293a4b5c6d7e8f901"
OTHER = "tok-cdn-0f1e2d3c4b5a69788796a5b4c3d2e1f0"


@pytest.fixture
def mirror_dir(artifact_dir: Path, artifacts: list[Artifact], tmp_path: Path) -> Path:
    """A mirror holding the first half of the artifacts only."""
    root = tmp_path / "mirror"
    for a in artifacts[: len(artifacts) // 2]:
        target = root / a.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((artifact_dir / a.name).read_bytes())
    return root


@pytest.fixture
def mirror(mirror_dir: Path) -> Iterator[LoopbackOrigin]:
    with LoopbackOrigin(mirror_dir) as server:
        yield server


@pytest.fixture
def cdn(artifact_dir: Path) -> Iterator[LoopbackOrigin]:
    # Another loopback address: another host, as a public CDN is.
    with LoopbackOrigin(artifact_dir, host="127.0.0.2") as server:
        yield server


@pytest.fixture
def configured(mirror: LoopbackOrigin, cdn: LoopbackOrigin, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """DISTCACHE_ORIGIN=mirror,cdn with DISTCACHE_ORIGIN_TOKEN, in the environment."""
    env = {
        "DISTCACHE_ORIGIN": f"{mirror.url},{cdn.url}",
        "DISTCACHE_ORIGIN_TOKEN": TOKEN,
        "DISTCACHE_POOL": str(tmp_path / "pool"),
        "DISTCACHE_LOG_JSON": str(tmp_path / "events.jsonl"),
        "DISTCACHE_HTTP_RETRIES": "0",
    }
    for name in ("DISTCACHE_ORIGIN_TOKENS", "FLASHINFER_CUBINS_REPOSITORY", "DISTCACHE_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def authorizations(server: LoopbackOrigin) -> list[str | None]:
    return [h.get("authorization") for h in server.request_headers]


def assert_only_the_mirror_saw_the_token(mirror: LoopbackOrigin, cdn: LoopbackOrigin,
                                         missing: int) -> None:
    assert mirror.total_requests > 0
    assert set(authorizations(mirror)) == {f"Bearer {TOKEN}"}
    assert cdn.total_requests == missing  # the cdn was asked for what the mirror lacks
    assert authorizations(cdn) == [None] * missing


def everything_shown(exc: BaseException) -> str:
    texts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None:
        texts += [str(seen), repr(seen), repr(vars(seen))]
        if isinstance(seen, DistcacheError):
            texts.append(repr(vars(pickle.loads(pickle.dumps(seen)))))
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


# -- the library -------------------------------------------------------------------


def test_the_token_goes_to_the_first_http_origin_only(
    configured: dict[str, str], mirror: LoopbackOrigin, cdn: LoopbackOrigin,
    artifacts: list[Artifact], tmp_path: Path,
) -> None:
    origin = open_origin(list(settings().origins))
    assert isinstance(origin, OriginChain)
    pool = ArtifactPool(tmp_path / "pool")
    for a in artifacts:
        assert sha256_hex(pool.fetch(a, origin)) == a.sha256
    missing = len(artifacts) - len(artifacts) // 2
    assert_only_the_mirror_saw_the_token(mirror, cdn, missing)
    shown = [repr(origin), origin.describe(), repr(settings()),
             repr(Credentials.from_settings(settings()))]
    assert not any(TOKEN in text for text in shown)


def test_a_prefetch_sends_the_token_to_the_mirror_only(
    configured: dict[str, str], mirror: LoopbackOrigin, cdn: LoopbackOrigin,
    artifacts: list[Artifact], tmp_path: Path,
) -> None:
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(manifest_text(artifacts))
    with distcache.init(comm=LocalCommunicator(), manifests=[manifest], integrations=()) as session:
        assert session.report is not None and session.report.downloads == len(artifacts)
    assert_only_the_mirror_saw_the_token(mirror, cdn, len(artifacts) - len(artifacts) // 2)
    assert TOKEN not in Path(configured["DISTCACHE_LOG_JSON"]).read_text()


def test_an_explicit_origin_gets_the_token_only_when_distcache_origin_has_no_http_entry(
    configured: dict[str, str], mirror: LoopbackOrigin, cdn: LoopbackOrigin,
    artifacts: list[Artifact], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DISTCACHE_ORIGIN names the mirror: `--origin cdn` must not carry the mirror's token.
    origin = resolve_origin(cdn.url, settings())
    assert origin is not None
    origin.fetch(artifacts[-1])
    assert authorizations(cdn) == [None]
    # Without DISTCACHE_ORIGIN the token is for the first http entry of the argument.
    monkeypatch.delenv("DISTCACHE_ORIGIN")
    origin = resolve_origin([mirror.url, cdn.url], settings())
    assert origin is not None
    origin.fetch(artifacts[-1])
    assert authorizations(mirror) == [f"Bearer {TOKEN}"]
    assert authorizations(cdn) == [None, None]


def test_an_integration_default_origin_gets_no_token_unless_one_is_bound_to_its_host(
    configured: dict[str, str], cdn: LoopbackOrigin, artifacts: list[Artifact],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DISTCACHE_ORIGIN")
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", cdn.url)
    origin = resolve_origin(None, settings(), [fi.FlashInfer()])
    assert origin is not None and origin.describe() == cdn.url
    origin.fetch(artifacts[0])
    assert authorizations(cdn) == [None]
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKENS", f"{cdn.host}:{cdn.port}={OTHER}")
    origin = resolve_origin(None, settings(), [fi.FlashInfer()])
    assert origin is not None
    origin.fetch(artifacts[0])
    assert authorizations(cdn) == [None, f"Bearer {OTHER}"]


def test_per_host_tokens_bind_each_token_to_its_host(
    configured: dict[str, str], mirror: LoopbackOrigin, cdn: LoopbackOrigin,
    artifacts: list[Artifact], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKENS",
                       f" {cdn.host}:{cdn.port}={OTHER}, 127.0.0.9=unused ")
    origin = open_origin(list(settings().origins))
    assert isinstance(origin, OriginChain)
    origin.fetch(artifacts[-1])  # the mirror lacks it: both are asked
    assert authorizations(mirror) == [f"Bearer {TOKEN}"]
    assert authorizations(cdn) == [f"Bearer {OTHER}"]
    # A map entry wins over DISTCACHE_ORIGIN_TOKEN for the host they share; a host
    # without a port means the scheme's default port, not every port.
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKENS", f"{mirror.host}:{mirror.port}={OTHER}")
    open_origin(mirror.url).fetch(artifacts[0])
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKENS", f"{mirror.host}={OTHER}")
    open_origin(mirror.url).fetch(artifacts[0])
    assert authorizations(mirror)[1:] == [f"Bearer {OTHER}", f"Bearer {TOKEN}"]


@pytest.mark.parametrize("value", ["mirror.example", "=tok-secret-x", "a/b=tok-secret-x",
                                   "host:99999=tok-secret-x", "host=tok-secret-\x07"])
def test_a_malformed_token_map_is_a_config_error_that_quotes_no_token(value: str) -> None:
    conf = settings({"DISTCACHE_ORIGIN_TOKENS": f"ok.example=tok-secret-ok,{value}"})
    with pytest.raises(ConfigError, match="DISTCACHE_ORIGIN_TOKENS") as info:
        Credentials.from_settings(conf)
    assert "secret" not in everything_shown(info.value)


# -- redirects ---------------------------------------------------------------------


@pytest.mark.parametrize("target_host", ["127.0.0.2", "127.0.0.1"])
def test_a_redirect_to_another_host_or_port_drops_the_token(
    mirror: LoopbackOrigin, artifact_dir: Path, artifacts: list[Artifact], target_host: str,
) -> None:
    # Another host, or the same host on another port (another origin all the same).
    with LoopbackOrigin(artifact_dir, host=target_host) as elsewhere:
        origin = HttpOrigin(mirror.url, token=TOKEN, retries=0,
                            allow_redirect_hosts=[target_host])
        mirror.inject("redirect", base=elsewhere.url, count=None)
        assert sha256_hex(origin.fetch(artifacts[-1])) == artifacts[-1].sha256
        assert authorizations(mirror) == [f"Bearer {TOKEN}"]
        assert elsewhere.total_requests == 1
        assert authorizations(elsewhere) == [None]
        # Back to the origin itself through the other host: the token again, there only.
        mirror.reset()
        elsewhere.inject("redirect", base=mirror.url, count=1)
        chain = HttpOrigin(elsewhere.url, token=None, retries=0,
                           allow_redirect_hosts=["127.0.0.1"])
        chain.fetch(artifacts[0])
        assert authorizations(elsewhere)[-1] is None and authorizations(mirror) == [None]


def test_a_redirect_to_a_host_not_allowed_is_refused_and_never_contacted(
    mirror: LoopbackOrigin, cdn: LoopbackOrigin, artifacts: list[Artifact],
) -> None:
    origin = HttpOrigin(mirror.url, token=TOKEN, retries=0)
    mirror.inject("redirect", base=cdn.url, count=None)
    with pytest.raises(OriginError, match="refused redirect to another host") as info:
        origin.fetch(artifacts[0])
    assert cdn.total_requests == 0
    assert TOKEN not in everything_shown(info.value)


def test_a_netrc_entry_does_not_replace_the_bound_token(
    mirror: LoopbackOrigin, artifacts: list[Artifact], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine {mirror.host} login user password from-netrc\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    HttpOrigin(mirror.url, token=TOKEN).fetch(artifacts[0])
    HttpOrigin(mirror.url).fetch(artifacts[0])  # no token bound: netrc applies, per host
    first, second = authorizations(mirror)
    assert first == f"Bearer {TOKEN}"
    assert second is not None and second.startswith("Basic ")


# -- the CLI -----------------------------------------------------------------------


def test_cli_fetch_sends_the_token_to_the_mirror_only_and_never_prints_it(
    configured: dict[str, str], mirror: LoopbackOrigin, cdn: LoopbackOrigin,
    artifacts: list[Artifact], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    manifest = tmp_path / "checksums.txt"
    # One artifact nobody has: its failure is printed and listed in the JSON.
    nowhere = Artifact("nowhere/x.cubin", sha256_hex(b"x"))
    manifest.write_text(manifest_text([*artifacts, nowhere]))
    assert cli.main(["fetch", "--manifest", str(manifest), "--json", "--jobs", "1"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["fetched"] == len(artifacts) and summary["failed"] == 1
    missing = len(artifacts) - len(artifacts) // 2
    assert_only_the_mirror_saw_the_token(mirror, cdn, missing + 1)
    assert TOKEN not in out and TOKEN not in err
    assert cli.main(["prefetch", "--manifest", str(manifest), "--json"]) == 1
    out, err = capsys.readouterr()
    assert "nowhere/x.cubin" in out + err
    assert TOKEN not in out + err
    events = Path(configured["DISTCACHE_LOG_JSON"])
    assert TOKEN not in (events.read_text() if events.exists() else "")
    assert authorizations(cdn) == [None] * cdn.total_requests


# -- the FlashInfer wrapper --------------------------------------------------------


@pytest.fixture
def loader_module() -> Iterator[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlashInfer's own dependencies warn on import
        import flashinfer.jit.cubin_loader as module
    yield module
    fi.uninstall()


def test_the_flashinfer_wrapper_sends_the_token_to_the_mirror_only(
    configured: dict[str, str], mirror: LoopbackOrigin, cdn: LoopbackOrigin,
    artifacts: list[Artifact], loader_module: Any, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", tmp_path / "cubins")
    loader = fi.install(ArtifactPool(tmp_path / "pool"))
    assert loader is not None
    for a in artifacts:
        assert sha256_hex(loader_module.get_artifact(a.name, a.sha256)) == a.sha256
    assert_only_the_mirror_saw_the_token(mirror, cdn, len(artifacts) - len(artifacts) // 2)
    assert TOKEN not in caplog.text


def test_the_flashinfer_wrapper_sends_no_token_to_flashinfers_repository(
    configured: dict[str, str], cdn: LoopbackOrigin, artifacts: list[Artifact],
    loader_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DISTCACHE_ORIGIN")
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", cdn.url)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", tmp_path / "cubins")
    assert fi.install(ArtifactPool(tmp_path / "pool")) is not None
    a = artifacts[0]
    assert sha256_hex(loader_module.get_artifact(a.name, a.sha256)) == a.sha256
    assert cdn.total_requests == 1 and authorizations(cdn) == [None]
