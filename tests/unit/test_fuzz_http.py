"""HttpOrigin against hostile servers: every failure is typed, nothing unverified leaks.

A raw socket server answers with whatever bytes a test hands it (malformed,
duplicated or lying headers, redirects anywhere, endless bodies), and the real
:class:`LoopbackOrigin` covers redirect chains. The properties: ``fetch`` returns the
artifact's exact bytes or raises ``OriginError``/``IntegrityError``; after a failure a
seekable output holds nothing, and no output ever holds a byte past the artifact's
declared size; a body longer than declared is cut off early rather than buffered.
"""

from __future__ import annotations

import contextlib
import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import IntegrityError, OriginError
from distcache.origins import HttpOrigin
from distcache.testing import LoopbackOrigin
from tests.support.origins import closing_fixture, servers_fixture

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=120,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

BODY = bytes(range(256)) * 40  # 10240 bytes
SHA = sha256_hex(BODY)
ARTIFACT = Artifact("fmha/k.cubin", SHA, len(BODY))
UNSIZED = Artifact("fmha/k.cubin", SHA)

Responder = Callable[[int, bytes], bytes | Iterator[bytes]]


class RawServer:
    """Answers each connection with ``respond(index, request)`` and closes it."""

    def __init__(self, respond: Responder) -> None:
        self.respond = respond
        self.requests: list[bytes] = []
        self.sent = 0
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    request = b""
                    while b"\r\n\r\n" not in request:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        request += chunk
                    self.requests.append(request)
                    answer = self.respond(len(self.requests) - 1, request)
                    for piece in [answer] if isinstance(answer, bytes) else answer:
                        conn.sendall(piece)
                        self.sent += len(piece)
                except OSError:
                    pass  # the client hung up: that is what some tests wait for

    def close(self) -> None:
        self._stop.set()
        # close() alone does not wake a thread blocked in accept(); shutdown() does.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)
        assert not self._thread.is_alive(), "raw server thread did not stop"


raw = servers_fixture(RawServer)
_opened: list[HttpOrigin] = []
_close_origins = closing_fixture(_opened)


def origin(url: str, **kwargs: Any) -> HttpOrigin:
    kwargs.setdefault("retries", 1)
    _opened.append(HttpOrigin(url, timeout=5, sleep=lambda _s: None, **kwargs))
    return _opened[-1]


def response(status: str, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> bytes:
    head = b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    return b"HTTP/1.1 " + status.encode() + b"\r\n" + head + b"Connection: close\r\n\r\n" + body


def outcome(origin_: HttpOrigin, artifact: Artifact = ARTIFACT) -> tuple[str, bytes]:
    """("ok" | error class name, what the output holds afterwards)."""
    out = io.BytesIO()
    try:
        count = origin_.fetch_into(artifact, out)
    except (OriginError, IntegrityError) as exc:
        return type(exc).__name__, out.getvalue()
    assert count == len(out.getvalue())
    return "ok", out.getvalue()


# -- malformed and lying headers --------------------------------------------------------

length_values = st.sampled_from([
    b"-1", b"-10240", b"0", b"1", b"10239", b"10240", b"10241", b"99999999999999999999999",
    b"abc", b"", b" 10240 ", b"10240, 10240", b"10240, 5", b"0x2800", b"1e4", b"+10240",
    b"\xb2", b"\xd9\xa1", b"10240\x00",
])
bodies = st.sampled_from([
    BODY, BODY[:-1], BODY + b"x", BODY[:100], b"", BODY[:5000] + b"\xff" + BODY[5001:],
    BODY * 3,
])


# See _close_origins: urllib3 leaves the socket of a refused response to the collector.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@FUZZ
@given(
    status=st.sampled_from(["200 OK", "200 ", "201 Created", "206 Partial", "204 No Content",
                            "404 Not Found", "500 Oops", "999 What", "299 Odd"]),
    lengths=st.lists(length_values, max_size=3),
    extra=st.lists(st.sampled_from([
        (b"Content-Encoding", b"gzip"), (b"Transfer-Encoding", b"chunked"),
        (b"Retry-After", b"nan"), (b"Retry-After", b"-5"), (b"Retry-After", b"1e400"),
        (b"Retry-After", b"Mon, 01 Jan 99999 00:00:00 GMT"), (b"Location", b"http://[::1"),
        (b"X-Junk", b"\xff\xfe"), (b"Content-Type", b"text/html"),
    ]), max_size=3),
    body=bodies,
    sized=st.booleans(),
)
def test_any_answer_is_the_exact_bytes_or_a_typed_error(
    raw: Callable[[Responder], RawServer],
    status: str,
    lengths: list[bytes],
    extra: list[tuple[bytes, bytes]],
    body: bytes,
    sized: bool,
) -> None:
    headers = [(b"Content-Length", v) for v in lengths] + extra
    server = raw(lambda _i, _r: response(status, headers, body))
    artifact = ARTIFACT if sized else UNSIZED
    result, held = outcome(origin(server.url), artifact)
    if result == "ok":
        assert held == BODY
    else:
        assert held == b""  # a failed fetch leaves a seekable output empty
    server.close()


class _Watched(io.BytesIO):
    """An output that remembers the most it ever held (a rewind hides what was there)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def write(self, data: Any) -> int:
        count = super().write(data)
        self.most = max(self.most, self.tell())
        return count


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@FUZZ
@given(
    cap=st.sampled_from([1, 100, len(BODY) - 1, len(BODY), len(BODY) + 1, 3 * len(BODY)]),
    body=bodies,
    framing=st.sampled_from(["close", "chunked", "length"]),
)
def test_no_output_ever_holds_more_than_the_cap_for_an_artifact_of_unknown_size(
    raw: Callable[[Responder], RawServer], cap: int, body: bytes, framing: str
) -> None:
    if framing == "chunked":
        pieces = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 999]), body[i:i + 999])
                          for i in range(0, len(body), 999))
        answer = response("200 OK", [(b"Transfer-Encoding", b"chunked")], pieces + b"0\r\n\r\n")
    elif framing == "length":
        answer = response("200 OK", [(b"Content-Length", str(len(body)).encode())], body)
    else:  # the body ends when the server closes
        answer = response("200 OK", [], body)
    server = raw(lambda _i, _r: answer)
    out = _Watched()
    try:
        origin(server.url, max_bytes=cap).fetch_into(UNSIZED, out)
        result = "ok"
    except (OriginError, IntegrityError) as exc:
        result = str(exc)
    assert out.most <= cap
    if result == "ok":
        assert out.getvalue() == BODY and len(BODY) <= cap
    else:
        assert out.getvalue() == b""
        if len(body) > cap:
            assert f"exceeds the cap of {cap} bytes" in result
    server.close()


@pytest.mark.parametrize("length", [b"\xb2", b"\xd9\xa1\xd9\xa2"])
def test_non_ascii_digits_in_content_length_are_ignored_not_a_crash(
    raw: Callable[[Responder], RawServer], length: bytes
) -> None:
    # str.isdigit() accepts "²"; int() does not: this used to escape as ValueError.
    server = raw(lambda _i, _r: response("200 OK", [(b"Content-Length", length)], BODY))
    assert outcome(origin(server.url), UNSIZED) == ("ok", BODY)


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_conflicting_duplicate_content_lengths_are_an_origin_error(
    raw: Callable[[Responder], RawServer],
) -> None:
    server = raw(lambda _i, _r: response(
        "200 OK", [(b"Content-Length", b"10240"), (b"Content-Length", b"10241")], BODY))
    assert outcome(origin(server.url)) == ("OriginError", b"")


def test_content_length_larger_than_the_artifact_is_refused_before_the_body(
    raw: Callable[[Responder], RawServer],
) -> None:
    def endless(_i: int, _r: bytes) -> Iterator[bytes]:
        yield response("200 OK", [(b"Content-Length", str(1 << 40).encode())])
        for _ in range(64 * 1024):  # up to 4 GiB, if nobody hangs up
            yield b"\0" * 65536

    server = raw(endless)
    out = io.BytesIO()
    with pytest.raises(IntegrityError, match="Content-Length 1099511627776"):
        origin(server.url, retries=0).fetch_into(ARTIFACT, out)
    assert out.getvalue() == b""
    assert server.sent < 64 << 20  # refused on the header, not after the body


@pytest.mark.parametrize("announce", [True, False])
def test_a_body_longer_than_declared_is_cut_off_early_and_never_written(
    raw: Callable[[Responder], RawServer], announce: bool
) -> None:
    def endless(_i: int, _r: bytes) -> Iterator[bytes]:
        # With the right Content-Length, then more bytes than it said; or
        # close-delimited with no length at all.
        headers = [(b"Content-Length", str(len(BODY)).encode())] if announce else []
        yield response("200 OK", headers, BODY)
        for _ in range(64 * 1024):
            yield b"\0" * 65536

    server = raw(endless)

    class Unseekable(io.RawIOBase):
        def __init__(self) -> None:
            self.data = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            self.data += bytes(b)
            return len(b)

    out = Unseekable()
    with contextlib.suppress(OriginError, IntegrityError):
        origin(server.url, retries=0).fetch_into(ARTIFACT, out)  # type: ignore[arg-type]
    # Either the exact bytes (the extra was never read) or a refusal; never more than
    # the declared size in the output, and the server was stopped early.
    assert len(out.data) <= len(BODY)
    assert bytes(out.data) == BODY[: len(out.data)]
    assert server.sent < 64 << 20


def test_wrong_bytes_of_the_right_length_are_never_returned(
    raw: Callable[[Responder], RawServer],
) -> None:
    bad = BODY[:-1] + b"\0"
    server = raw(lambda _i, _r: response("200 OK", [(b"Content-Length", b"10240")], bad))
    for artifact in (ARTIFACT, UNSIZED):
        with pytest.raises(IntegrityError):
            origin(server.url).fetch(artifact)
    assert len(server.requests) == 4  # retried once per fetch, then refused


# -- redirects ------------------------------------------------------------------------

@pytest.mark.parametrize(
    "location",
    [
        "file:///etc/passwd", "ftp://127.0.0.1/k.cubin", "gopher://127.0.0.1:70/_x",
        "javascript:alert(1)", "data:application/octet-stream;base64,AAAA",
        "https://127.0.0.1/k.cubin", "//evil.invalid/k.cubin", "http://evil.invalid/k.cubin",
        "http://127.0.0.1:1/k.cubin", "http://[::1/k.cubin", "http://127.0.0.1:99999/k",
        "http://user:pw@evil.invalid/",
    ],
)
def test_redirects_to_other_schemes_hosts_or_ports_are_refused(
    origin_server: LoopbackOrigin, location: str
) -> None:
    origin_server.inject("redirect", location=location, count=None)
    with pytest.raises(OriginError, match=r"redirect|Invalid|URL") as info:
        origin(origin_server.url, retries=3).fetch(ARTIFACT)
    assert origin_server.total_requests == 1  # refused at once, never retried
    assert "pw" not in str(info.value)


def test_relative_redirect_on_the_same_origin_is_followed(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    target = artifacts[0]
    origin_server.inject("redirect", path="moved.cubin", location=f"/{target.name}")
    moved = Artifact("moved.cubin", target.sha256, target.size)
    assert origin(origin_server.url).fetch(moved) == origin(origin_server.url).fetch(target)


def test_redirect_loops_stop_after_a_bounded_number_of_hops(
    origin_server: LoopbackOrigin,
) -> None:
    origin_server.inject("redirect", base=origin_server.url, count=None)
    with pytest.raises(OriginError, match="redirects"):
        origin(origin_server.url, retries=2).fetch(ARTIFACT)
    assert origin_server.total_requests == 6  # the request and five hops, no retries


def test_redirect_to_another_port_needs_the_host_allowed(
    origin_server: LoopbackOrigin, artifact_dir: Any, artifacts: list[Artifact]
) -> None:
    with LoopbackOrigin(artifact_dir, host="127.0.0.1") as other:
        target = other.url.replace("127.0.0.1", "localhost")
        origin_server.inject("redirect", base=target, count=None)
        with pytest.raises(OriginError, match="another host"):
            origin(origin_server.url).fetch(artifacts[0])
        assert other.total_requests == 0
        allowed = origin(origin_server.url, allow_redirect_hosts=["localhost"])
        assert allowed.fetch(artifacts[0]) == (artifact_dir / artifacts[0].name).read_bytes()
        assert other.total_requests == 1


def test_wrong_bytes_from_the_loopback_origin_raise_integrity_error(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("wrong_bytes", count=None)
    result, held = outcome(origin(origin_server.url, retries=2), artifacts[0])
    assert (result, held) == ("IntegrityError", b"")
    assert origin_server.total_requests == 3


def test_a_body_dripped_a_byte_at_a_time_is_cut_off_and_retried(
    raw: Callable[[Responder], RawServer],
) -> None:
    # Every read returns within the socket timeout, so only a per-attempt budget
    # (timeout + body at a minimum rate) stops this server from holding a fetch forever.
    def drip(index: int, request: bytes) -> Iterator[bytes]:
        yield response("200 OK", [(b"Content-Length", str(len(BODY)).encode())])
        for i in range(len(BODY)):
            time.sleep(0.02)
            yield BODY[i:i + 1]

    server = raw(drip)
    # The server answers one connection at a time and notices the dropped first
    # attempt only at its next write: a read timeout of 1.5 s leaves the retry time to
    # be accepted on a loaded machine; the drip (50 B/s) still stalls past the budget.
    slow = HttpOrigin(server.url, timeout=1.5, retries=1, sleep=lambda _s: None)
    _opened.append(slow)
    out = io.BytesIO()
    with pytest.raises(OriginError, match="stalled"):
        slow.fetch_into(ARTIFACT, out)
    assert len(server.requests) == 2
    assert server.sent < len(BODY)
