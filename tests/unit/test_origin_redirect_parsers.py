"""A redirect is checked on the URL that will be sent. ``urljoin``/``urlsplit`` read a
host after the last ``@``; urllib3, which connects, ends the host at a backslash. A
``Location`` written for that difference passed the same-host check as the origin
itself and took the origin's bearer token to another host; such a target (a
backslash, user-info, a host the two parsers read differently) is now refused, and
an accepted one is followed in its prepared form, the one the check looked at."""

from __future__ import annotations

from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import OriginError
from distcache.origins import HttpOrigin
from distcache.origins._response import redirect_target
from distcache.testing import LoopbackOrigin

TOKEN = "tok-redirect-parsers-0123456789"


def _authorizations(server: LoopbackOrigin) -> list[str | None]:
    return [h.get("authorization") for h in server.request_headers]


@pytest.mark.parametrize("shape", ["backslash", "user-info"])
def test_a_location_the_parsers_read_differently_is_refused_and_gets_no_token(
        artifact_dir: Path, artifacts: list[Artifact], shape: str) -> None:
    with LoopbackOrigin(artifact_dir) as origin_server, \
            LoopbackOrigin(artifact_dir, host="127.0.0.2") as elsewhere:
        here = f"{origin_server.host}:{origin_server.port}"
        there = f"{elsewhere.host}:{elsewhere.port}"
        # urlsplit reads the origin's host and port after the '@'.
        sep = "\\@" if shape == "backslash" else "@"
        origin_server.inject("redirect", location=f"http://{there}{sep}{here}/{artifacts[0].name}",
                             count=None)
        origin = HttpOrigin(origin_server.url, token=TOKEN, retries=0)
        with pytest.raises(OriginError, match="refused redirect") as info:
            origin.fetch(artifacts[0])
        assert elsewhere.total_requests == 0
        assert _authorizations(origin_server) == [f"Bearer {TOKEN}"]
        assert TOKEN not in str(info.value)


def test_a_location_allowed_elsewhere_is_followed_as_prepared_without_the_token(
        artifact_dir: Path, artifacts: list[Artifact]) -> None:
    with LoopbackOrigin(artifact_dir) as origin_server, \
            LoopbackOrigin(artifact_dir, host="127.0.0.2") as elsewhere:
        origin_server.inject("redirect", location=f"{elsewhere.url}/{artifacts[1].name}",
                             count=None)
        origin = HttpOrigin(origin_server.url, token=TOKEN, retries=0,
                            allow_redirect_hosts=["127.0.0.2"])
        assert sha256_hex(origin.fetch(artifacts[1])) == artifacts[1].sha256
        assert _authorizations(elsewhere) == [None]


@pytest.mark.parametrize(("location", "expected"), [
    ("/b/c?x=1", "http://127.0.0.1:8000/b/c?x=1"),
    ("//other:81/x", "http://other:81/x"),
    ("http://[::1]:9000/x", "http://[::1]:9000/x"),
    ("https://cdn.example/x y", "https://cdn.example/x%20y"),
    ("HTTP://H:80/x", "http://h:80/x"),
])
def test_a_plain_location_resolves_to_its_prepared_form(location: str, expected: str) -> None:
    assert redirect_target("http://127.0.0.1:8000/a", location) == expected


@pytest.mark.parametrize("location", [
    "http://localhost:9000\\@127.0.0.1:8000/a.bin",
    "http://evil\\.example/x",
    "http://user:pass@127.0.0.1:8000/x",
    "http://127.0.0.1:8000\x00.evil/x",
    "http://127.0.0.1:99999/x",
    "http://[::1/x",
])
def test_an_ambiguous_or_broken_location_is_refused(location: str) -> None:
    with pytest.raises(ValueError):
        redirect_target("http://127.0.0.1:8000/a", location)


def test_a_signed_query_quoted_by_a_transport_error_is_never_shown(
        artifact_dir: Path, artifacts: list[Artifact], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib3 quotes the request's path and query in its errors ("Max retries
    exceeded with url: /obj?sig=..."): a signed URL's secret must reach neither the
    log, the error, nor the error's cause."""
    import requests

    secret = "SIGNATURE-0123456789abcdef"
    with LoopbackOrigin(artifact_dir) as origin_server:
        origin = HttpOrigin(origin_server.url, token=TOKEN, retries=0)
        session, _ = origin._ready()

        def failing_get(url: str, **kwargs: object) -> requests.Response:
            raise requests.exceptions.ReadTimeout(
                f"HTTPConnectionPool(host='cdn', port=80): Max retries exceeded with url: "
                f"/obj?sig={secret}&se=2030 (Caused by ReadTimeoutError('timed out'))")

        monkeypatch.setattr(session, "get", failing_get)
        caplog.set_level("DEBUG")
        with pytest.raises(OriginError) as info:
            origin.fetch(artifacts[0])
    shown: list[str] = []
    seen: BaseException | None = info.value
    while seen is not None:
        shown += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    assert "ReadTimeout" in shown[0]
    assert secret not in "\n".join(shown)
    assert secret not in caplog.text
