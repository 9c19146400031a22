"""Origins against a real loopback HTTP server and real directories."""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, BinaryIO

import pytest

import distcache
from distcache.artifact import Artifact, sha256_hex
from distcache.errors import (
    ArtifactNameError,
    ArtifactNotFound,
    ConfigError,
    IntegrityError,
    OriginError,
    OriginUnreachable,
)
from distcache.origins import (
    BaseOrigin,
    DirOrigin,
    HttpOrigin,
    Origin,
    OriginChain,
    _http,
    open_origin,
)
from distcache.origins._open import SCHEMES
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin

TOKEN = "tok-5f1e2d3c4b5a69788796a5b4c3d2e1f0"


class Sleeps(list[float]):
    """Records backoff waits instead of sleeping, so retry tests take no time."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def http(origin_server: LoopbackOrigin, sleeps: Sleeps) -> HttpOrigin:
    return HttpOrigin(origin_server.url, timeout=5, retries=3, sleep=sleeps)


def test_fetch_returns_verified_bytes_with_one_request(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact], artifact_dir: Path
) -> None:
    a = artifacts[0]
    assert http.fetch(a) == (artifact_dir / a.name).read_bytes()
    assert origin_server.requests[a.name] == 1
    assert origin_server.total_requests == 1


def test_fetch_into_streams_to_a_file_and_returns_the_byte_count(
    http: HttpOrigin, artifacts: list[Artifact], tmp_path: Path
) -> None:
    a = max(artifacts, key=lambda x: x.size or 0)
    target = tmp_path / "out.bin"
    with open(target, "wb") as out:
        assert http.fetch_into(a, out) == a.size
    assert sha256_hex(target.read_bytes()) == a.sha256


def test_server_errors_are_retried_until_success(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    origin_server.inject("500", count=2)
    assert sha256_hex(http.fetch(artifacts[0])) == artifacts[0].sha256
    assert origin_server.total_requests == 3
    assert len(sleeps) == 2


def test_persistent_server_errors_raise_origin_error_after_all_retries(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("500", count=None)
    with pytest.raises(OriginError) as info:
        http.fetch(artifacts[0])
    assert origin_server.total_requests == 4  # 1 + retries
    assert info.value.status == 500
    assert "after 4 attempts" in str(info.value)
    assert origin_server.url in str(info.value)


def test_rate_limit_honours_retry_after(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    origin_server.inject("429", retry_after=7)
    http.fetch(artifacts[0])
    assert sleeps == [7.0]
    assert origin_server.total_requests == 2


def test_retry_after_is_capped(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    origin = HttpOrigin(origin_server.url, retries=2, retry_after_max=2.5, sleep=sleeps)
    origin_server.inject("429", retry_after=3600)
    origin.fetch(artifacts[0])
    assert sleeps == [2.5]


def test_total_backoff_is_capped(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    origin = HttpOrigin(
        origin_server.url, retries=10, retry_after_max=4, backoff_total=10, sleep=sleeps
    )
    origin_server.inject("429", count=None, retry_after=4)
    with pytest.raises(OriginError):
        origin.fetch(artifacts[0])
    assert sum(sleeps) <= 10
    assert origin_server.total_requests < 11  # stopped early: the budget ran out


def test_backoff_grows_and_stays_under_its_cap(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    origin = HttpOrigin(origin_server.url, retries=6, backoff_base=1, backoff_max=3, sleep=sleeps)
    origin_server.inject("500", count=None)
    with pytest.raises(OriginError):
        origin.fetch(artifacts[0])
    assert len(sleeps) == 6
    assert all(0 <= s <= 3 for s in sleeps)
    assert sleeps[0] <= 1


def test_truncated_body_is_retried(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("truncate", fraction=0.3)
    assert sha256_hex(http.fetch(artifacts[0])) == artifacts[0].sha256
    assert origin_server.total_requests == 2


def test_always_truncated_body_raises_origin_error(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("truncate", count=None)
    with pytest.raises(OriginError, match="cut short"):
        http.fetch(artifacts[0])
    assert origin_server.total_requests == 4


def test_retry_discards_the_partial_bytes_of_a_failed_attempt(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("truncate", fraction=0.9)
    out = io.BytesIO()
    out.write(b"prefix")
    http.fetch_into(artifacts[1], out)
    data = out.getvalue()
    assert data.startswith(b"prefix")
    assert sha256_hex(data[len(b"prefix") :]) == artifacts[1].sha256


def test_wrong_bytes_are_retried_and_never_returned(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("wrong_bytes")
    assert sha256_hex(http.fetch(artifacts[0])) == artifacts[0].sha256
    assert origin_server.total_requests == 2


def test_persistently_wrong_bytes_raise_integrity_error(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    a = artifacts[0]
    origin_server.inject("wrong_bytes", count=None)
    with pytest.raises(IntegrityError) as info:
        http.fetch(a)
    assert origin_server.total_requests == 4
    assert info.value.sha256 == a.sha256
    assert info.value.actual != a.sha256
    message = str(info.value)
    assert a.sha256 in message and a.name in message and "DISTCACHE_ORIGIN" in message


def test_wrong_size_from_the_server_is_an_integrity_error(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    a = artifacts[0]
    lying = Artifact(a.name, a.sha256, (a.size or 0) + 1)
    origin = HttpOrigin(origin_server.url, retries=1, sleep=sleeps)
    with pytest.raises(IntegrityError, match="size"):
        origin.fetch(lying)


def test_hanging_server_times_out_then_retry_succeeds(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    # A read timeout long enough that the retry is always answered in time, even on
    # a loaded machine; the hang (30 s) still outlasts it.
    origin = HttpOrigin(origin_server.url, timeout=2.0, retries=2, sleep=sleeps)
    origin_server.inject("hang", seconds=30)
    assert sha256_hex(origin.fetch(artifacts[0])) == artifacts[0].sha256
    assert origin_server.total_requests == 2
    assert len(sleeps) == 1


def test_not_found_is_not_retried(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    missing = Artifact("cubins/absent/kernel.cubin", "0" * 64)
    with pytest.raises(ArtifactNotFound) as info:
        http.fetch(missing)
    assert info.value.status == 404
    assert origin_server.total_requests == 1
    assert sleeps == []
    assert "cubins/absent/kernel.cubin" in str(info.value)


def test_injected_not_found_is_not_retried(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("404")
    with pytest.raises(ArtifactNotFound) as info:
        http.fetch(artifacts[0])
    assert info.value.status == 404
    assert origin_server.total_requests == 1


def test_connection_refused_is_not_retried_and_marks_the_origin_down(
    artifact_dir: Path, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    server = LoopbackOrigin(artifact_dir)
    url = server.url
    server.stop()
    origin = HttpOrigin(url, timeout=2, retries=2, sleep=sleeps)
    with pytest.raises(OriginUnreachable, match="unreachable: connection refused") as info:
        origin.fetch(artifacts[0])
    assert sleeps == []
    assert info.value.status is None
    assert info.value.cause == "connection refused"
    # The same port serving again does not matter while the origin is down...
    with LoopbackOrigin(artifact_dir, port=int(url.rsplit(":", 1)[1])) as again:
        with pytest.raises(OriginUnreachable, match="not asked again for 60 s"):
            origin.fetch(artifacts[1])
        assert again.total_requests == 0


def test_an_unreachable_origin_is_asked_again_once_it_has_been_down_long_enough(
    artifact_dir: Path, artifacts: list[Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A process that serves for days must find its mirror again after a restart.
    monkeypatch.setattr(_http, "DOWN_SECONDS", 0.2)
    server = LoopbackOrigin(artifact_dir)
    port = server.port
    server.stop()
    origin = HttpOrigin(server.url, retries=0)
    with pytest.raises(OriginUnreachable):
        origin.fetch(artifacts[0])
    with LoopbackOrigin(artifact_dir, port=port) as again:
        with pytest.raises(OriginUnreachable):
            origin.fetch(artifacts[0])
        time.sleep(0.3)
        assert sha256_hex(origin.fetch(artifacts[0])) == artifacts[0].sha256
        assert again.total_requests == 1


def test_same_host_redirect_is_followed(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    target = f"{origin_server.url}/{artifacts[1].name}"
    origin_server.inject("redirect", path=artifacts[0].name, count=None, location=target)
    # The redirect serves artifact 1's bytes under artifact 0's name: rejected as
    # corrupt, which proves the redirect was followed.
    with pytest.raises(IntegrityError):
        http.fetch(artifacts[0])
    origin_server.reset()
    origin_server.inject("redirect", path="alias/name.cubin", location=f"/{artifacts[0].name}")
    alias = Artifact("alias/name.cubin", artifacts[0].sha256)
    assert sha256_hex(http.fetch(alias)) == artifacts[0].sha256
    assert origin_server.total_requests == 2


def test_redirect_to_another_host_is_refused(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact], artifact_dir: Path
) -> None:
    with LoopbackOrigin(artifact_dir) as other:
        origin_server.inject("redirect", count=None, base=other.url)
        with pytest.raises(OriginError, match="refused redirect to another host") as info:
            http.fetch(artifacts[0])
        assert other.total_requests == 0
        assert origin_server.total_requests == 1
        assert info.value.status == 302


def test_redirect_to_an_allowed_host_is_followed_without_the_token(
    origin_server: LoopbackOrigin,
    artifacts: list[Artifact],
    artifact_dir: Path,
    sleeps: Sleeps,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with LoopbackOrigin(artifact_dir, host="127.0.0.2") as other:
        origin = HttpOrigin(origin_server.url, token=TOKEN, allow_redirect_hosts=["127.0.0.2"],
                            sleep=sleeps)
        origin_server.inject("redirect", base=other.url)
        assert sha256_hex(origin.fetch(artifacts[0])) == artifacts[0].sha256
        assert origin_server.last_headers["authorization"] == f"Bearer {TOKEN}"
        assert other.total_requests == 1
        assert "authorization" not in other.last_headers


@pytest.mark.parametrize(
    "location", ["https://{host}/x.cubin", "ftp://{host}/x.cubin", "file:///etc/passwd"]
)
def test_redirect_to_another_scheme_is_refused(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], sleeps: Sleeps, location: str
) -> None:
    origin = HttpOrigin(origin_server.url, allow_redirect_hosts=["127.0.0.1"], sleep=sleeps)
    host = f"127.0.0.1:{origin_server.port}"
    origin_server.inject("redirect", location=location.format(host=host))
    with pytest.raises(OriginError, match="another scheme"):
        origin.fetch(artifacts[0])
    assert origin_server.total_requests == 1


def test_endless_redirects_are_bounded(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("redirect", count=None, base=origin_server.url)
    with pytest.raises(OriginError, match="redirects"):
        http.fetch(artifacts[0])
    assert origin_server.total_requests == 6


def test_token_is_sent_but_never_shown(
    origin_server: LoopbackOrigin,
    artifacts: list[Artifact],
    sleeps: Sleeps,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("DISTCACHE_ORIGIN", origin_server.url)
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    origin = open_origin(origin_server.url)
    assert isinstance(origin, HttpOrigin)
    origin.retries = 2
    origin._sleep = sleeps
    origin.fetch(artifacts[0])
    assert origin_server.last_headers["authorization"] == f"Bearer {TOKEN}"
    messages = [origin.describe(), repr(origin), str(vars(origin).get("base_url"))]
    origin_server.inject("500", count=None)
    with pytest.raises(OriginError) as failed:
        origin.fetch(artifacts[0])
    messages.append(str(failed.value))
    messages.append(repr(failed.value))
    messages.append(repr(pickle.loads(pickle.dumps(failed.value)).__dict__))
    origin_server.reset()
    origin_server.inject("wrong_bytes", count=None)
    with pytest.raises(IntegrityError) as corrupt:
        origin.fetch(artifacts[0])
    messages.append(str(corrupt.value))
    messages.append(repr(corrupt.value.__dict__))
    messages.append(caplog.text)
    assert caplog.records  # the retries were logged
    for text in messages:
        assert TOKEN not in text


def test_credentials_in_the_url_are_not_shown(origin_server: LoopbackOrigin) -> None:
    origin = HttpOrigin(f"http://user:pa55word@127.0.0.1:{origin_server.port}/base")
    assert "pa55word" not in origin.describe()
    assert "pa55word" not in repr(origin)


@pytest.mark.parametrize(
    "url",
    [
        "ftp://mirror.example/cubins",
        "file:///srv/cubins",
        "mirror.example/cubins",
        "http:///nohost",
        "",
    ],
)
def test_non_http_urls_are_refused_at_construction(url: str) -> None:
    with pytest.raises(ConfigError, match="http"):
        HttpOrigin(url)


def test_timeout_and_retries_come_from_argument_then_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DISTCACHE_HTTP_TIMEOUT", "7.5")
    monkeypatch.setenv("DISTCACHE_HTTP_RETRIES", "0")
    from_env = HttpOrigin("http://127.0.0.1:1")
    assert (from_env.timeout, from_env.retries) == (7.5, 0)
    explicit = HttpOrigin("http://127.0.0.1:1", timeout=2, retries=5)
    assert (explicit.timeout, explicit.retries) == (2, 5)
    monkeypatch.setenv("DISTCACHE_HTTP_RETRIES", "many")
    with pytest.raises(ConfigError, match="DISTCACHE_HTTP_RETRIES"):
        HttpOrigin("http://127.0.0.1:1")


def test_names_are_quoted_in_urls(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifact_dir: Path
) -> None:
    name = "odd names/a kernel#1%20?.cubin"
    data = b"odd bytes"
    (artifact_dir / "odd names").mkdir()
    (artifact_dir / name).write_bytes(data)
    a = Artifact(name, sha256_hex(data), len(data))
    assert http.fetch(a) == data
    assert origin_server.requests[name] == 1
    assert http.url_for(a).endswith("/odd%20names/a%20kernel%231%2520%3F.cubin")


# -- DirOrigin ----------------------------------------------------------------------


def test_dir_origin_returns_verified_bytes(artifact_dir: Path, artifacts: list[Artifact]) -> None:
    origin = DirOrigin(artifact_dir)
    assert sha256_hex(origin.fetch(artifacts[0])) == artifacts[0].sha256
    assert isinstance(origin, Origin)


def test_dir_origin_missing_file_is_artifact_not_found(artifact_dir: Path) -> None:
    with pytest.raises(ArtifactNotFound) as info:
        DirOrigin(artifact_dir).fetch(Artifact("cubins/nope.cubin", "1" * 64))
    assert info.value.name == "cubins/nope.cubin"


def test_dir_origin_corrupt_file_raises_integrity_error(
    artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    a = artifacts[0]
    path = artifact_dir / a.name
    data = path.read_bytes()
    path.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(IntegrityError, match=a.sha256):
        DirOrigin(artifact_dir).fetch(a)


def test_dir_origin_refuses_symlinks_leaving_the_mirror(tmp_path: Path, artifact_dir: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret")
    (artifact_dir / "leak.cubin").symlink_to(secret)
    with pytest.raises(OriginError, match="outside mirror"):
        DirOrigin(artifact_dir).fetch(Artifact("leak.cubin", sha256_hex(b"secret")))


def test_dir_origin_follows_symlinks_inside_the_mirror(
    artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    a = artifacts[0]
    (artifact_dir / "alias.cubin").symlink_to(artifact_dir / a.name)
    assert sha256_hex(DirOrigin(artifact_dir).fetch(Artifact("alias.cubin", a.sha256))) == a.sha256


def test_dir_origin_refuses_traversal_even_past_artifact_validation(artifact_dir: Path) -> None:
    evil = Artifact("x.cubin", "2" * 64)
    object.__setattr__(evil, "name", "../../etc/passwd")
    with pytest.raises(ArtifactNameError):
        DirOrigin(artifact_dir).fetch(evil)


def test_dir_origin_directory_instead_of_file_is_an_origin_error(artifact_dir: Path) -> None:
    with pytest.raises(OriginError, match="directory"):
        DirOrigin(artifact_dir).fetch(Artifact("cubins", "3" * 64))


# -- OriginChain and open_origin ------------------------------------------------------


def test_chain_falls_through_to_the_next_origin(
    origin_server: LoopbackOrigin,
    artifact_dir: Path,
    artifacts: list[Artifact],
    sleeps: Sleeps,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with LoopbackOrigin(artifact_dir) as second:
        origin_server.inject("404", count=None)
        chain = OriginChain(
            [HttpOrigin(origin_server.url, sleep=sleeps), HttpOrigin(second.url, sleep=sleeps)]
        )
        with caplog.at_level(logging.WARNING):
            assert sha256_hex(chain.fetch(artifacts[0])) == artifacts[0].sha256
        assert origin_server.total_requests == 1
        assert second.total_requests == 1
        assert origin_server.url in caplog.text and second.url in caplog.text


def test_chain_falls_through_on_corrupt_bytes(
    origin_server: LoopbackOrigin, artifact_dir: Path, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    origin_server.inject("wrong_bytes", count=None)
    chain = OriginChain(
        [HttpOrigin(origin_server.url, retries=1, sleep=sleeps), DirOrigin(artifact_dir)]
    )
    out = io.BytesIO()
    assert chain.fetch_into(artifacts[0], out) == artifacts[0].size
    assert sha256_hex(out.getvalue()) == artifacts[0].sha256
    assert origin_server.total_requests == 2


def test_chain_stops_at_the_first_success(
    origin_server: LoopbackOrigin, artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    chain = OriginChain([DirOrigin(artifact_dir), HttpOrigin(origin_server.url)])
    chain.fetch(artifacts[0])
    assert origin_server.total_requests == 0


def test_chain_failure_lists_every_origin(
    origin_server: LoopbackOrigin, tmp_path: Path, artifact_dir: Path, sleeps: Sleeps
) -> None:
    missing = Artifact("cubins/missing.cubin", "4" * 64)
    chain = OriginChain([HttpOrigin(origin_server.url, sleep=sleeps), DirOrigin(tmp_path / "m")])
    with pytest.raises(OriginError) as info:
        chain.fetch(missing)
    message = str(info.value)
    assert origin_server.url in message and str(tmp_path / "m") in message
    assert isinstance(info.value, ArtifactNotFound)
    assert len(info.value.failures) == 2
    assert origin_server.total_requests == 1


def test_chain_failure_is_not_artifact_not_found_when_one_origin_failed_otherwise(
    origin_server: LoopbackOrigin, tmp_path: Path, artifacts: list[Artifact], sleeps: Sleeps
) -> None:
    origin_server.inject("500", count=None)
    chain = OriginChain(
        [DirOrigin(tmp_path), HttpOrigin(origin_server.url, retries=1, sleep=sleeps)]
    )
    with pytest.raises(OriginError) as info:
        chain.fetch(artifacts[0])
    assert not isinstance(info.value, ArtifactNotFound)
    assert info.value.status is None


def test_open_origin_parses_urls_directories_and_lists(tmp_path: Path) -> None:
    http = open_origin("http://127.0.0.1:9/base/")
    assert isinstance(http, HttpOrigin) and http.describe() == "http://127.0.0.1:9/base"
    assert isinstance(open_origin(str(tmp_path)), DirOrigin)
    assert isinstance(open_origin(f"file://{tmp_path}"), DirOrigin)
    chain = open_origin(f"http://127.0.0.1:9, {tmp_path}")
    assert isinstance(chain, OriginChain)
    assert [type(o) for o in chain.origins] == [HttpOrigin, DirOrigin]
    mixed = open_origin([DirOrigin(tmp_path), "https://mirror.example/x"])
    assert isinstance(mixed, OriginChain) and len(mixed.origins) == 2
    same = DirOrigin(tmp_path)
    assert open_origin(same) is same
    assert open_origin([same]) is same


@pytest.mark.parametrize("spec", ["", " , ", "ftp://mirror.example/x", "s3://bucket/x"])
def test_open_origin_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ConfigError):
        open_origin(spec)


def test_open_origin_unknown_scheme_names_the_spec_and_the_known_schemes() -> None:
    with pytest.raises(ConfigError) as info:
        open_origin("s3://key:secret@bucket/cubins?sig=abc")
    message = str(info.value)
    assert "s3://bucket/cubins" in message
    assert all(f"{scheme}://" in message for scheme in ("file", "http", "https"))
    assert "secret" not in message and "sig=abc" not in message
    assert info.value.value == "s3"


def test_open_origin_treats_a_colon_without_slashes_as_a_path(tmp_path: Path) -> None:
    (tmp_path / "a:b").mkdir()
    origin = open_origin(str(tmp_path / "a:b"))
    assert isinstance(origin, DirOrigin) and origin.path == tmp_path / "a:b"


@pytest.mark.parametrize("spec", ["127.0.0.1:42505", "mirror.example/cubins", "localhost"])
def test_an_origin_without_a_scheme_that_is_not_a_directory_is_refused(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no scheme and is not an existing directory") as info:
        open_origin(spec)
    assert f"http://{spec}" in info.value.message
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"\(a file\); give the path"):
        open_origin(str(tmp_path / "a-file"))
    with pytest.raises(ConfigError, match=r"\(no such directory\); give the path"):
        open_origin(str(tmp_path / "missing"))
    (tmp_path / spec.split("/")[0]).mkdir()
    if "/" in spec:
        (tmp_path / spec).mkdir()
    assert isinstance(open_origin(spec), DirOrigin)  # a directory of that name is one


def test_open_origin_rejects_a_malformed_url_as_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not a valid URL"):
        open_origin("http://[::1/cubins")


class _MemoryOrigin(BaseOrigin):
    """An origin written only as a streaming read, as a new kind of origin would be."""

    def __init__(self, spec: str, files: dict[str, bytes]) -> None:
        self.spec = spec
        self.files = files

    def describe(self) -> str:
        return self.spec

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        if artifact.name not in self.files:
            raise ArtifactNotFound(f"{artifact.name} is not in {self.spec}", name=artifact.name)
        return out.write(self.files[artifact.name])


def test_a_new_scheme_is_one_entry_in_the_scheme_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(SCHEMES, "mem", lambda spec, _credentials: _MemoryOrigin(spec, {}))
    chain = open_origin(f"mem://bucket/cubins,{tmp_path}")
    assert isinstance(chain, OriginChain)
    assert [type(o) for o in chain.origins] == [_MemoryOrigin, DirOrigin]
    assert chain.origins[0].describe() == "mem://bucket/cubins"


def test_base_origin_fetch_collects_what_fetch_into_streams() -> None:
    data = b"kernel bytes"
    origin = _MemoryOrigin("mem://x", {"k.cubin": data})
    assert isinstance(origin, Origin)
    assert origin.fetch(Artifact("k.cubin", sha256_hex(data))) == data
    with pytest.raises(ArtifactNotFound):
        origin.fetch(Artifact("other.cubin", sha256_hex(data)))


def test_base_origin_cannot_be_made_without_fetch_into() -> None:
    class Incomplete(BaseOrigin):
        def describe(self) -> str:
            return "incomplete"

    with pytest.raises(TypeError, match="fetch_into"):
        Incomplete()  # type: ignore[abstract]


def test_chain_of_origins_that_all_lack_the_artifact_is_artifact_not_found(
    tmp_path: Path,
) -> None:
    data = b"absent everywhere"
    chain = OriginChain([_MemoryOrigin("mem://a", {}), DirOrigin(tmp_path)])
    with pytest.raises(ArtifactNotFound) as info:
        chain.fetch(Artifact("k.cubin", sha256_hex(data)))
    assert [label for label, _ in info.value.failures] == ["mem://a", f"dir:{tmp_path}"]


def test_chain_needs_at_least_one_origin() -> None:
    with pytest.raises(ConfigError):
        OriginChain([])


def test_http_origin_reads_no_token_from_the_environment(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The variable is bound to one origin by open_origin; an HttpOrigin built directly
    # sends only the token it was given.
    monkeypatch.setenv("DISTCACHE_ORIGIN_TOKEN", TOKEN)
    monkeypatch.setenv("DISTCACHE_ORIGIN", origin_server.url)
    HttpOrigin(origin_server.url).fetch(artifacts[0])
    assert "authorization" not in origin_server.last_headers
    assert os.environ["DISTCACHE_ORIGIN_TOKEN"] == TOKEN


class _Pipe(io.RawIOBase):
    """A write-only stream that cannot seek, like a pipe or socket."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        chunk = bytes(b)  # type: ignore[call-overload]
        self.data += chunk
        return len(chunk)


def test_chain_into_an_unseekable_stream_falls_through_only_when_nothing_was_written(
    origin_server: LoopbackOrigin, artifact_dir: Path, artifacts: list[Artifact],
    tmp_path: Path, sleeps: Sleeps
) -> None:
    a = artifacts[0]
    clean = _Pipe()
    OriginChain([DirOrigin(tmp_path / "empty"), DirOrigin(artifact_dir)]).fetch_into(
        a, clean)  # type: ignore[arg-type]
    assert sha256_hex(bytes(clean.data)) == a.sha256
    # Large enough that part of the body is streamed before the cut.
    big_data = bytes(range(256)) * 8192
    (artifact_dir / "big.cubin").write_bytes(big_data)
    big = Artifact("big.cubin", sha256_hex(big_data), len(big_data))
    origin_server.inject("truncate", count=None, fraction=0.9)
    dirty = _Pipe()
    chain = OriginChain([HttpOrigin(origin_server.url, retries=2, sleep=sleeps),
                         DirOrigin(artifact_dir)])
    with pytest.raises(OriginError, match="tried 1 of 2"):
        chain.fetch_into(big, dirty)  # type: ignore[arg-type]
    assert 0 < len(dirty.data) < len(big_data)
    assert origin_server.total_requests == 1  # no retry into a stream it cannot rewind


def test_caller_credentials_are_not_forwarded_to_redirect_hosts(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], artifact_dir: Path, sleeps: Sleeps
) -> None:
    with LoopbackOrigin(artifact_dir, host="127.0.0.2") as other:
        origin = HttpOrigin(origin_server.url, headers={"Authorization": "Basic c2VjcmV0",
                                                        "X-Trace": "1"},
                            allow_redirect_hosts=["127.0.0.2"], sleep=sleeps)
        origin_server.inject("redirect", base=other.url)
        origin.fetch(artifacts[0])
        assert origin_server.last_headers["authorization"] == "Basic c2VjcmV0"
        assert "authorization" not in other.last_headers
        # Nor any other header the caller set: which of them hold secrets is unknown.
        assert "x-trace" not in other.last_headers
        assert origin_server.last_headers["x-trace"] == "1"


def test_errors_survive_pickling_with_their_attributes(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("404")
    with pytest.raises(OriginError) as info:
        http.fetch(artifacts[0])
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is ArtifactNotFound
    assert (copy.status, copy.name, str(copy)) == (404, artifacts[0].name, str(info.value))


def test_http_origin_names_itself_in_the_user_agent(
    http: HttpOrigin, origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    http.fetch(artifacts[0])
    assert origin_server.last_headers["user-agent"] == f"distcache/{distcache.__version__}"


# -- bodies without a Content-Length ---------------------------------------------------


def test_a_healthy_chunked_body_at_1_mib_per_s_is_not_judged_against_its_unknown_length(
    tmp_path: Path,
) -> None:
    # An artifact from checksums.txt has no size and the body no Content-Length: 12 MiB
    # at 1 MiB/s takes 12 s, far past a budget computed for an unknown length.
    data = os.urandom(12 << 20)
    (tmp_path / "big.so").write_bytes(data)
    with LoopbackOrigin(tmp_path, bandwidth=1 << 20) as server:
        server.inject("chunked", count=None)
        origin = HttpOrigin(server.url, timeout=2, retries=0)
        out = io.BytesIO()
        assert origin.fetch_into(Artifact("big.so", sha256_hex(data)), out) == len(data)
        assert "content-length" not in {k.lower() for k in server.request_headers[0]}
        assert server.total_requests == 1
    assert sha256_hex(out.getvalue()) == sha256_hex(data)


def test_a_body_that_slows_to_a_drip_after_a_fast_start_is_stalled(tmp_path: Path) -> None:
    # Judged over a window, not over the whole body: 4 MiB fast, then nearly nothing,
    # is abandoned a window after the drip starts, not once the average sinks.
    data = os.urandom(5 << 20)
    (tmp_path / "k.so").write_bytes(data)
    with LoopbackOrigin(tmp_path) as server:
        server.inject("chunked", count=None)
        origin = HttpOrigin(server.url, timeout=2, retries=0)
        fast = _Pacer(server, after=4 << 20, rate=16 * 1024)
        started = time.monotonic()
        with pytest.raises(OriginError, match="body stalled") as info:
            origin.fetch_into(Artifact("k.so", sha256_hex(data)), fast)
        assert time.monotonic() - started < 30
    assert "in the last" in info.value.message
    assert fast.tell() == 0  # rewound: nothing of the failed attempt is kept


class _Pacer(io.BytesIO):
    """An output that, past ``after`` bytes, accepts them at ``rate`` bytes/s only: a
    slow consumer slows the socket reads just as a slow server does."""

    def __init__(self, server: LoopbackOrigin, *, after: int, rate: float) -> None:
        super().__init__()
        self.after = after
        self.rate = rate

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.after:
            time.sleep(len(data) / self.rate)
        return super().write(data)


def test_an_endless_body_is_refused_at_the_cap_and_nothing_reaches_the_pool(
    origin_server: LoopbackOrigin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", "1M")
    origin = open_origin(origin_server.url)
    assert isinstance(origin, HttpOrigin) and origin.max_bytes == 1 << 20
    origin_server.inject("endless", count=None)
    pool = ArtifactPool(tmp_path / "pool")
    unsized = Artifact("fmha/endless.cubin", sha256_hex(b"never"))
    started = time.monotonic()
    with pytest.raises(OriginError, match="exceeds the cap of 1048576 bytes") as info:
        pool.fetch(unsized, origin)
    assert time.monotonic() - started < 10
    assert "DISTCACHE_MAX_ARTIFACT_BYTES" in info.value.message
    assert origin_server.total_requests == 1  # a body over the cap is not retried
    assert not pool.has(unsized.sha256)
    assert [p for p in (tmp_path / "pool").rglob("*") if p.is_file()
            and (p.suffix == ".tmp" or "objects" in p.parts)] == []


def test_a_body_announced_over_the_cap_is_refused_before_a_byte_is_read(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    big = max(artifacts, key=lambda a: a.size or 0)
    assert big.size is not None
    origin = HttpOrigin(origin_server.url, max_bytes=big.size - 1, retries=3)
    out = io.BytesIO()
    with pytest.raises(OriginError, match=f"announced Content-Length {big.size}"):
        origin.fetch_into(Artifact(big.name, big.sha256), out)
    assert out.getvalue() == b"" and origin_server.total_requests == 1
    # The cap is for unknown sizes: a declared size is its own limit.
    assert origin.fetch_into(big, out) == big.size


def test_a_bad_byte_cap_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        HttpOrigin("http://127.0.0.1:9", max_bytes=0)
    monkeypatch.setenv("DISTCACHE_MAX_ARTIFACT_BYTES", "lots")
    with pytest.raises(ConfigError, match="DISTCACHE_MAX_ARTIFACT_BYTES"):
        HttpOrigin("http://127.0.0.1:9")


def test_an_http_origin_imports_its_http_stack_with_its_first_request(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], artifact_dir: Path
) -> None:
    # Most ranks of a job send no request: opening the origin (every init does) must not
    # import requests and urllib3, which cost a rank more CPU than the rest of an init.
    import subprocess
    import sys

    first = artifacts[0]
    name, digest = first.name, sha256_hex((artifact_dir / first.name).read_bytes())
    code = f"""
import io, sys
from distcache.artifact import Artifact
from distcache.origins import open_origin
origin = open_origin({origin_server.url!r})
print(sorted(m for m in ("requests", "urllib3", "importlib.metadata") if m in sys.modules))
out = io.BytesIO()
origin.fetch_into(Artifact({name!r}, {digest!r}), out)
print(len(out.getvalue()) == {first.size!r}, "requests" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True True"], done.stdout
    assert origin_server.total_requests == 1
