"""Origins against servers that misbehave on purpose, and mirrors that move.

Each HTTP test runs a small raw socket server on 127.0.0.1 whose handler writes
whatever the test hands it (headers a byte at a time, a chunk-size line that never
ends, trailers for ever), and fetches in a thread joined with a generous timeout: a
fetch still running then is a hang.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective._download import download_objects
from distcache.errors import ArtifactNotFound, IntegrityError, OriginError
from distcache.origins import DirOrigin, HttpOrigin, OriginChain
from distcache.origins._response import retry_after
from distcache.store._pool import ArtifactPool
from tests.support.origins import ThreadedRawServer, close_all

BODY = bytes(range(256)) * 60  # 15360 bytes
SHA = sha256_hex(BODY)
SIZED = Artifact("fmha/k.cubin", SHA, len(BODY))
UNSIZED = Artifact("fmha/k.cubin", SHA)
#: Seconds after which a fetch still running is taken for a hang: far beyond any
#: deadline an attempt has here (the smallest timeout counts as 2 s).
HANG = 60.0

#: (index of the connection, the request's path, the connection, the stop event).
Responder = Callable[[int, str, socket.socket, threading.Event], None]


class Server(ThreadedRawServer):
    """A raw server whose responders are given the request's path and the stop event."""

    def __init__(self, respond: Responder) -> None:
        self.paths: list[str] = []

        def raw(index: int, request: bytes, conn: socket.socket) -> None:
            path = request.split(b" ", 2)[1].decode()
            self.paths.append(path)
            respond(index, path, conn, self.stop)

        super().__init__(raw)


_servers: list[Server] = []
_opened: list[HttpOrigin] = []


@pytest.fixture(autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    close_all(_opened)
    while _servers:
        _servers.pop().close()


def serve(respond: Responder) -> Server:
    _servers.append(Server(respond))
    return _servers[-1]


def http(url: str, **kwargs: Any) -> HttpOrigin:
    kwargs.setdefault("retries", 0)
    kwargs.setdefault("timeout", 0.5)
    kwargs.setdefault("sleep", lambda _s: None)
    _opened.append(HttpOrigin(url, **kwargs))
    return _opened[-1]


def answer(body: bytes, headers: tuple[tuple[str, str], ...] = (), status: str = "200 OK") -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (f"HTTP/1.1 {status}\r\n{lines}Content-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


def fetch_in_thread(origin: Any, artifact: Artifact) -> BaseException | bytes:
    """``origin.fetch(artifact)``'s outcome; fails the test when it hangs."""
    outcome: list[BaseException | bytes] = []

    def run() -> None:
        try:
            outcome.append(origin.fetch(artifact))
        except BaseException as exc:  # reported to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG)
    hung = thread.is_alive()
    for server in _servers:
        server.stop.set()  # lets a server still dripping end, and a hung fetch with it
    thread.join(HANG)
    assert not hung, "the fetch hung: an attempt has no deadline"
    return outcome[0]


def no_watchdog_left() -> bool:
    """At most the process's one watching thread, and no attempt it still watches."""
    from distcache.origins import _watchdog

    watchers = [t for t in threading.enumerate() if t.name == "distcache-http-watchdog"]
    return len(watchers) <= 1 and not _watchdog._WATCHER._due


# -- 1. every attempt has a deadline --------------------------------------------------


def drip_headers(index: int, path: str, conn: socket.socket, stop: threading.Event) -> None:
    # One byte of a header line each 0.1 s: every read gets a byte within the timeout.
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not stop.wait(0.1):
        conn.sendall(b"a")


def test_headers_sent_a_byte_at_a_time_end_the_attempt_as_a_timeout() -> None:
    server = serve(drip_headers)
    outcome = fetch_in_thread(http(server.url), SIZED)
    assert isinstance(outcome, OriginError) and not isinstance(outcome, ArtifactNotFound)
    message = str(outcome)
    assert server.url in message and "timed out" in message and "headers" in message
    assert no_watchdog_left()


def test_attempts_share_one_watching_thread(tmp_path: Path) -> None:
    from distcache.testing import LoopbackOrigin, make_artifacts

    artifacts = make_artifacts(tmp_path / "mirror", 6, min_size=100, max_size=200, seed=4)
    with LoopbackOrigin(tmp_path / "mirror") as server, HttpOrigin(server.url) as origin:
        seen: set[threading.Thread] = set()  # the threads themselves (an ident is reused)
        for _ in range(5):
            for artifact in artifacts:
                origin.fetch(artifact)
                seen |= {t for t in threading.enumerate()
                         if t.name == "distcache-http-watchdog"}
    assert len(seen) == 1  # 30 attempts, one thread: none started per attempt
    assert no_watchdog_left()


def test_a_timed_out_attempt_is_retried_and_the_next_one_delivers() -> None:
    def respond(index: int, path: str, conn: socket.socket, stop: threading.Event) -> None:
        if index == 0:
            drip_headers(index, path, conn, stop)
        else:
            conn.sendall(answer(BODY))

    server = serve(respond)
    sleeps: list[float] = []
    assert fetch_in_thread(http(server.url, retries=1, sleep=sleeps.append), SIZED) == BODY
    assert len(server.paths) == 2 and len(sleeps) == 1
    assert no_watchdog_left()


def test_a_chunk_size_line_that_never_ends_times_out() -> None:
    def respond(index: int, path: str, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n")
        while not stop.wait(0.1):
            conn.sendall(b"0")

    server = serve(respond)
    outcome = fetch_in_thread(http(server.url), UNSIZED)
    assert isinstance(outcome, OriginError), outcome
    assert "timed out" in str(outcome) and "4 in all" in str(outcome)
    assert no_watchdog_left()


def test_trailers_without_end_after_the_last_chunk_time_out() -> None:
    def respond(index: int, path: str, conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n")
        while not stop.wait(0.02):
            conn.sendall(b"X-Trailer: " + b"t" * 1000 + b"\r\n")

    server = serve(respond)
    outcome = fetch_in_thread(http(server.url), SIZED)
    assert isinstance(outcome, OriginError), outcome
    assert server.url in str(outcome) and "timed out" in str(outcome)
    assert no_watchdog_left()


# -- 2. a chain whose members fail only this artifact fails only this artifact --------


def test_a_chain_of_a_mirror_lacking_it_and_a_cdn_with_bad_bytes_fails_one_artifact(
    tmp_path: Path,
) -> None:
    data = {name: name.encode() * 500 for name in "abcd"}
    artifacts = [Artifact(n, sha256_hex(b), len(b)) for n, b in data.items()]

    def respond(index: int, path: str, conn: socket.socket, stop: threading.Event) -> None:
        name = path.strip("/")
        conn.sendall(answer(b"X" * len(data[name]) if name == "a" else data[name]))

    server = serve(respond)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    chain = OriginChain([DirOrigin(mirror), http(server.url)])
    with pytest.raises(IntegrityError) as info:
        chain.fetch(artifacts[0])
    assert str(mirror) in str(info.value) and server.url in str(info.value)
    pool = ArtifactPool(tmp_path / "pool")
    result = download_objects(pool, chain, artifacts, workers=1)
    assert result.downloads == 3
    assert result.failure is not None and isinstance(result.failure[1], IntegrityError)
    assert [a.name for a in artifacts if pool.has(a.sha256)] == ["b", "c", "d"]


# -- 3. the destination's write errors are not the mirror's --------------------------


class _FullDisk(io.BytesIO):
    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_destination_is_not_blamed_on_the_mirror_nor_fetched_again(
    tmp_path: Path,
) -> None:
    (tmp_path / "fmha").mkdir()
    (tmp_path / "fmha" / "k.cubin").write_bytes(BODY)
    with pytest.raises(OSError) as info:
        DirOrigin(tmp_path).fetch_into(SIZED, _FullDisk())
    assert not isinstance(info.value, OriginError) and info.value.errno == errno.ENOSPC
    server = serve(lambda index, path, conn, stop: conn.sendall(answer(BODY)))
    chain = OriginChain([DirOrigin(tmp_path), http(server.url)])
    with pytest.raises(OSError) as info:
        chain.fetch_into(SIZED, _FullDisk())
    assert not isinstance(info.value, OriginError)
    assert server.paths == []  # the next origin was not asked


# -- 4. a mirror whose root moves ----------------------------------------------------


def test_a_mirror_behind_a_symlink_follows_a_release_flip(tmp_path: Path) -> None:
    for release in ("v1", "v2"):
        (tmp_path / release / "fmha").mkdir(parents=True)
        (tmp_path / release / "fmha" / "k.cubin").write_bytes(BODY)
    current = tmp_path / "current"
    current.symlink_to("v1")
    origin = DirOrigin(current)
    assert origin.fetch(SIZED) == BODY
    (tmp_path / "next").symlink_to("v2")
    os.replace(tmp_path / "next", current)
    assert origin.fetch(SIZED) == BODY
    # Still refused: a file outside every release.
    (tmp_path / "outside").write_bytes(BODY)
    (tmp_path / "v2" / "escape").symlink_to(tmp_path / "outside")
    with pytest.raises(OriginError, match="outside mirror"):
        origin.fetch(Artifact("escape", SHA, len(BODY)))


def test_a_relative_mirror_path_stays_where_it_was_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for place in ("here", "elsewhere"):
        (tmp_path / place / "m" / "fmha").mkdir(parents=True)
        (tmp_path / place / "m" / "fmha" / "k.cubin").write_bytes(BODY)
    monkeypatch.chdir(tmp_path / "here")
    origin = DirOrigin("m")
    assert origin.fetch(SIZED) == BODY
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert origin.fetch(SIZED) == BODY
    (tmp_path / "here" / "m" / "fmha" / "k.cubin").unlink()
    with pytest.raises(ArtifactNotFound, match=str(tmp_path / "here")):
        origin.fetch(SIZED)


# -- 5. a body labelled with a Content-Encoding is judged by its digest ---------------


def test_a_body_labelled_x_gzip_is_accepted_when_its_digest_matches() -> None:
    blob = gzip.compress(BODY)
    tarball = Artifact("k.tar.gz", sha256_hex(blob), len(blob))
    server = serve(lambda index, path, conn, stop: conn.sendall(
        answer(blob, (("Content-Type", "application/x-tar"), ("Content-Encoding", "x-gzip")))))
    assert http(server.url).fetch(tarball) == blob


def test_a_coded_body_with_the_wrong_digest_names_its_encoding() -> None:
    server = serve(lambda index, path, conn, stop: conn.sendall(
        answer(gzip.compress(BODY), (("Content-Encoding", "gzip"),))))
    with pytest.raises(IntegrityError, match="Content-Encoding: gzip"):
        http(server.url).fetch(UNSIZED)


# -- 6. a Retry-After that is no wait leaves the jittered backoff in charge ----------


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "-inf", "1e400"])
def test_a_negative_or_infinite_retry_after_is_no_hint(value: str) -> None:
    assert retry_after(value) is None


@pytest.mark.parametrize("value", ["-5", "nan"])
def test_ranks_told_to_retry_after_a_negative_or_nan_wait_back_off_with_jitter(
    value: str,
) -> None:
    server = serve(lambda index, path, conn, stop: conn.sendall(
        answer(b"", (("Retry-After", value),), status="503 Busy")))
    sleeps: list[float] = []
    with pytest.raises(OriginError, match="HTTP 503"):
        http(server.url, retries=4, sleep=sleeps.append).fetch(SIZED)
    assert len(sleeps) == 4 and len(server.paths) == 5
    assert all(s > 0 for s in sleeps) and len(set(sleeps)) == 4


def test_a_mirror_file_that_became_a_directory_is_the_mirrors_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stat

    from distcache.origins import _directory

    (tmp_path / "m" / "a").mkdir(parents=True)
    real_stat = os.stat

    class Regular:  # what the stat saw before the file was swapped for a directory
        st_mode = stat.S_IFREG | 0o644

    def swapped(path: Any, *args: Any, **kwargs: Any) -> Any:
        return Regular() if str(path).endswith("/a") else real_stat(path, *args, **kwargs)

    monkeypatch.setattr(_directory.os, "stat", swapped)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OriginError, match="is a directory, not a file"):  # a chain goes on
        DirOrigin(tmp_path / "m").fetch_into(Artifact("a", "0" * 64, 10), io.BytesIO())
    assert len(os.listdir("/proc/self/fd")) == fds
