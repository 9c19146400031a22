"""An origin that cannot be reached at all fails fast, once, with its cause.

A refused connection or a host name that does not resolve is not worth a retry per
artifact: the origin is marked down for the run, a chain skips it, and
``distcache fetch`` prints one line naming the origin and the cause.
"""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from distcache import cli
from distcache.artifact import Artifact, manifest_text, sha256_hex
from distcache.errors import OriginUnreachable
from distcache.origins import HttpOrigin, OriginChain, open_origin
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def twenty(tmp_path: Path) -> Path:
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(manifest_text(
        [Artifact(f"fmha/k{i:02d}.cubin", sha256_hex(str(i).encode())) for i in range(20)]))
    return manifest


def test_fetch_from_a_refused_origin_prints_one_line_with_the_cause_within_2_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("DISTCACHE_ORIGIN", "DISTCACHE_OFFLINE", "DISTCACHE_HTTP_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    origin = f"http://127.0.0.1:{closed_port()}"
    manifest = twenty(tmp_path)
    started = time.monotonic()
    code = cli.main(["--pool", str(tmp_path / "pool"), "fetch", "--manifest", str(manifest),
                     "--origin", origin])
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 1
    assert elapsed < 2.0, f"took {elapsed:.1f} s"
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert origin in lines[0] and "connection refused" in lines[0]
    assert "20 artifacts not fetched" in lines[0]
    assert "20 failed" in out


def test_an_unresolvable_host_is_not_retried_and_fails_every_later_fetch_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lookups: list[str] = []
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "mirror.invalid":
            lookups.append(host)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    sleeps: list[float] = []
    origin = HttpOrigin("http://mirror.invalid/cubins", retries=4, sleep=sleeps.append)
    for i in range(5):
        with pytest.raises(OriginUnreachable, match="host name does not resolve") as info:
            origin.fetch(Artifact(f"k{i}.cubin", sha256_hex(b"x")))
        assert "http://mirror.invalid/cubins" in info.value.message
    assert lookups == ["mirror.invalid"] and sleeps == []
    assert info.value.cause == "host name does not resolve (Name or service not known)"


def test_a_temporary_resolver_failure_is_retried_not_marked_down(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures = [socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")]
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    sleeps: list[float] = []
    origin = HttpOrigin(origin_server.url, retries=2, sleep=sleeps.append)
    assert sha256_hex(origin.fetch(artifacts[0])) == artifacts[0].sha256
    assert len(sleeps) == 1 and origin_server.total_requests == 1


def test_a_chain_skips_a_refused_origin_for_the_rest_of_the_run_with_one_warning(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    dead = HttpOrigin(f"http://127.0.0.1:{closed_port()}", retries=4)
    chain = OriginChain([dead, HttpOrigin(origin_server.url)])
    pool = ArtifactPool(tmp_path / "pool")
    for a in artifacts:
        assert sha256_hex(pool.fetch(a, chain)) == a.sha256
    assert origin_server.total_requests == len(artifacts)
    warned = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warned) == 1 and "connection refused" in warned[0]
    assert not [r for r in caplog.records if "trying" in r.getMessage()]


def test_a_chain_of_unreachable_origins_is_unreachable_naming_each_cause(
    artifacts: list[Artifact],
) -> None:
    first, second = (f"http://127.0.0.1:{closed_port()}" for _ in range(2))
    chain = open_origin(f"{first},{second}")
    for a in artifacts[:3]:
        with pytest.raises(OriginUnreachable) as info:
            chain.fetch(a)
        assert f"{first} (connection refused), {second} (connection refused)" in str(info.value)


def test_a_server_that_answers_badly_is_still_retried(
    origin_server: LoopbackOrigin, artifacts: list[Artifact],
) -> None:
    # Only a connection that never forms marks an origin down; a 500 is retried.
    sleeps: list[float] = []
    origin = HttpOrigin(origin_server.url, retries=2, sleep=sleeps.append)
    origin_server.inject("500", count=2)
    assert sha256_hex(origin.fetch(artifacts[0])) == artifacts[0].sha256
    assert len(sleeps) == 2
