"""The loopback origin itself: serving, counting, faults, shutdown, and make_artifacts."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from distcache.artifact import Artifact, parse_checksums, sha256_hex, validate_name
from distcache.comm._base import poll_until
from distcache.testing import LoopbackOrigin, make_artifacts
from distcache.testing._loopback_wire import Bandwidth as _Bandwidth

REPO = Path(__file__).resolve().parents[2]


def _raw_get(server: LoopbackOrigin, path: str) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body; the body is what arrived before the server closed.
    http.client sends the path exactly as given (requests would normalise "..")."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        headers = dict(response.headers)
        try:
            body = response.read()
        except http.client.IncompleteRead as exc:
            body = exc.partial
        return response.status, headers, body
    finally:
        conn.close()


def test_serves_files_and_counts_requests_and_bytes(
    origin_server: LoopbackOrigin, artifacts: list[Artifact], artifact_dir: Path
) -> None:
    a, b = artifacts[0], artifacts[1]
    for _ in range(2):
        assert (
            requests.get(f"{origin_server.url}/{a.name}", timeout=10).content
            == (artifact_dir / a.name).read_bytes()
        )
    requests.get(f"{origin_server.url}/{b.name}", timeout=10)
    assert origin_server.requests == {a.name: 2, b.name: 1}
    assert origin_server.total_requests == 3
    # The handler counts a chunk after writing it: the client may hold the last bytes
    # a moment before the count includes them.
    expected = 2 * (a.size or 0) + (b.size or 0)
    poll_until(lambda: origin_server.bytes_sent == expected, time.monotonic() + 5)
    assert origin_server.bytes_sent == expected


def test_stats_and_reset_over_http(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    requests.get(f"{origin_server.url}/{artifacts[0].name}", timeout=10)
    requests.get(f"{origin_server.url}/no/such.cubin", timeout=10)
    stats: dict[str, Any] = {}

    def counted() -> bool:  # the last chunk may be counted a moment after it arrived
        stats.update(requests.get(f"{origin_server.url}/_stats", timeout=10).json())
        return bool(stats["bytes_sent"] == artifacts[0].size)

    poll_until(counted, time.monotonic() + 5)
    assert stats["total_requests"] == 2
    assert stats["requests"] == {artifacts[0].name: 1, "no/such.cubin": 1}
    assert stats["bytes_sent"] == artifacts[0].size
    assert requests.post(f"{origin_server.url}/_reset", timeout=10).status_code == 200
    assert requests.get(f"{origin_server.url}/_stats", timeout=10).json() == {
        "total_requests": 0,
        "requests": {},
        "bytes_sent": 0,
    }


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.bin",
        "/cubins/../../secret.bin",
        "/%2e%2e/secret.bin",
        "//etc/passwd",
        "/a\\..\\..\\secret.bin",
    ],
)
def test_paths_outside_the_root_are_refused(
    origin_server: LoopbackOrigin, artifact_dir: Path, path: str
) -> None:
    (artifact_dir.parent / "secret.bin").write_bytes(b"secret")
    status, _headers, body = _raw_get(origin_server, path)
    assert status == 404
    assert b"secret" not in body


def test_symlinks_leaving_the_root_are_refused(
    origin_server: LoopbackOrigin, artifact_dir: Path
) -> None:
    (artifact_dir.parent / "secret.bin").write_bytes(b"secret")
    (artifact_dir / "link.cubin").symlink_to(artifact_dir.parent / "secret.bin")
    assert requests.get(f"{origin_server.url}/link.cubin", timeout=10).status_code == 404


def test_faults_apply_count_times_then_stop(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    url = f"{origin_server.url}/{artifacts[0].name}"
    origin_server.inject("500", count=2)
    assert [requests.get(url, timeout=10).status_code for _ in range(3)] == [500, 500, 200]


def test_faults_on_one_path_leave_others_alone(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("404", path=artifacts[1].name, count=None)
    assert requests.get(f"{origin_server.url}/{artifacts[0].name}", timeout=10).ok
    for _ in range(2):
        assert (
            requests.get(f"{origin_server.url}/{artifacts[1].name}", timeout=10).status_code == 404
        )


def test_rate_limit_fault_sends_retry_after(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("429", retry_after=5)
    response = requests.get(f"{origin_server.url}/{artifacts[0].name}", timeout=10)
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "5"


def test_truncate_fault_closes_before_content_length(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("truncate", fraction=0.25)
    status, headers, body = _raw_get(origin_server, f"/{artifacts[0].name}")
    assert status == 200
    assert int(headers["Content-Length"]) == artifacts[0].size
    assert len(body) == int((artifacts[0].size or 0) * 0.25)


def test_wrong_bytes_fault_keeps_the_length_and_changes_the_digest(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("wrong_bytes")
    body = requests.get(f"{origin_server.url}/{artifacts[0].name}", timeout=10).content
    assert len(body) == artifacts[0].size
    assert sha256_hex(body) != artifacts[0].sha256


def test_latency_fault_still_answers_correctly(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("latency", seconds=0.05)
    body = requests.get(f"{origin_server.url}/{artifacts[0].name}", timeout=10).content
    assert sha256_hex(body) == artifacts[0].sha256


def test_redirect_fault_points_at_another_base(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("redirect", base="http://mirror.invalid/x", status=307)
    response = requests.get(
        f"{origin_server.url}/{artifacts[0].name}", timeout=10, allow_redirects=False
    )
    assert response.status_code == 307
    assert response.headers["Location"] == f"http://mirror.invalid/x/{artifacts[0].name}"


def test_chunked_fault_sends_the_file_without_a_content_length(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("chunked")
    response = requests.get(f"{origin_server.url}/{artifacts[0].name}", timeout=10)
    assert response.headers.get("Transfer-Encoding") == "chunked"
    assert "Content-Length" not in response.headers
    assert sha256_hex(response.content) == artifacts[0].sha256
    assert origin_server.bytes_sent == artifacts[0].size


def test_endless_fault_never_ends_the_body(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    origin_server.inject("endless")
    with requests.get(f"{origin_server.url}/{artifacts[0].name}", timeout=10,
                      stream=True) as response:
        assert "Content-Length" not in response.headers
        received = 0
        for piece in response.iter_content(1 << 16):
            received += len(piece)
            if received > 8 << 20:
                break
    assert received > 8 << 20


def test_every_request_s_headers_are_recorded_until_reset(
    origin_server: LoopbackOrigin, artifacts: list[Artifact]
) -> None:
    for value in ("Bearer one", None, "Bearer two"):
        headers = {"Authorization": value} if value else {}
        requests.get(f"{origin_server.url}/{artifacts[0].name}", headers=headers, timeout=10)
    requests.get(f"{origin_server.url}/_stats", timeout=10)  # not an artifact request
    seen = [h.get("authorization") for h in origin_server.request_headers]
    assert seen == ["Bearer one", None, "Bearer two"]
    assert origin_server.last_headers["authorization"] == "Bearer two"
    origin_server.reset()
    assert origin_server.request_headers == [] and origin_server.last_headers == {}


def test_unknown_faults_and_bad_counts_are_rejected(origin_server: LoopbackOrigin) -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        origin_server.inject("teapot")
    with pytest.raises(ValueError, match="count"):
        origin_server.inject("500", count=0)
    with pytest.raises(ValueError, match="location"):
        origin_server.inject("redirect")


def test_stop_is_prompt_with_a_hanging_handler(
    artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    server = LoopbackOrigin(artifact_dir)
    server.inject("hang", seconds=600)
    outcome: list[BaseException | int] = []

    def client() -> None:
        try:
            outcome.append(
                requests.get(f"{server.url}/{artifacts[0].name}", timeout=600).status_code
            )
        except requests.RequestException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    while server.total_requests == 0:
        threading.Event().wait(0.01)
    server.stop()
    server.stop()  # idempotent
    thread.join(timeout=30)
    assert not thread.is_alive(), "stop() left the hanging request open"
    assert len(outcome) == 1 and isinstance(outcome[0], requests.ConnectionError)


_FORKED_CHILD = """
import http.client, os, sys
from distcache.testing import LoopbackOrigin
server = LoopbackOrigin(sys.argv[1])
kept = http.client.HTTPConnection(server.host, server.port, timeout=10)
kept.request("GET", "/" + sys.argv[2]); kept.getresponse().read()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the interpreter's exit: the origin's finalizer runs in the child
_, status = os.waitpid(pid, 0)
kept.request("GET", "/" + sys.argv[2])  # the connection the child held a copy of
first = kept.getresponse().status
fresh = http.client.HTTPConnection(server.host, server.port, timeout=10)
fresh.request("GET", "/" + sys.argv[2])
print(os.waitstatus_to_exitcode(status), first, fresh.getresponse().status)
server.stop()
"""


def test_a_forked_child_exits_and_leaves_the_parent_serving(
    artifact_dir: Path, artifacts: list[Artifact]
) -> None:
    # The child has copies of the sockets and no serving thread: at its exit it
    # must not wait for that thread's loop, nor cut the parent's connections.
    done = subprocess.run(
        [sys.executable, "-c", _FORKED_CHILD, str(artifact_dir), artifacts[0].name],
        capture_output=True, text=True, timeout=30, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "200", "200"]


def test_bandwidth_is_shared_by_all_connections() -> None:
    waits: list[float] = []

    class Recorder(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waits.append(timeout or 0.0)
            return False

    bucket = _Bandwidth(1000.0, Recorder())
    for _ in range(4):
        bucket.wait(500)
    # Four half-second chunks on one clock: each waits for all the chunks before it.
    assert len(waits) == 4
    assert waits[-1] > 1.9
    assert waits == sorted(waits)


def test_invalid_settings_are_rejected(artifact_dir: Path) -> None:
    with pytest.raises(ValueError, match="latency"):
        LoopbackOrigin(artifact_dir, latency=-1)
    with pytest.raises(ValueError, match="bandwidth"):
        LoopbackOrigin(artifact_dir, bandwidth=0)


def test_make_artifacts_is_deterministic_and_writes_checksums(tmp_path: Path) -> None:
    first = make_artifacts(tmp_path / "a", 7, min_size=100, max_size=3000, seed=3)
    again = make_artifacts(tmp_path / "b", 7, min_size=100, max_size=3000, seed=3)
    other = make_artifacts(tmp_path / "c", 7, min_size=100, max_size=3000, seed=4)
    assert first == again
    assert {a.sha256 for a in first}.isdisjoint({a.sha256 for a in other})
    assert len({a.sha256 for a in first}) == 7
    listed = parse_checksums((tmp_path / "a" / "checksums.txt").read_text())
    assert [(a.name, a.sha256) for a in listed] == [(a.name, a.sha256) for a in first]
    for a in first:
        data = (tmp_path / "a" / a.name).read_bytes()
        assert sha256_hex(data) == a.sha256 and len(data) == a.size
        assert 100 <= len(data) <= 3000
        assert validate_name(a.name) == a.name
        assert a.name.startswith("cubins/") and a.name.endswith(".cubin")
        assert a.name.count("/") >= 3


def test_make_artifacts_without_prefix_and_with_tiny_sizes(tmp_path: Path) -> None:
    made = make_artifacts(tmp_path, 3, min_size=1, max_size=4, prefix="")
    assert all(not a.name.startswith("cubins/") and 1 <= (a.size or 0) <= 4 for a in made)
    with pytest.raises(ValueError):
        make_artifacts(tmp_path, -1)
    with pytest.raises(ValueError):
        make_artifacts(tmp_path, 1, min_size=10, max_size=5)


def test_origin_server_script_generates_serves_and_writes_its_port(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "scripts" / "origin_server.py"),
            "--root",
            str(tmp_path / "root"),
            "--generate",
            "3",
            "--min-size",
            "100",
            "--max-size",
            "200",
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        port = int(port_file.read_text())
        assert url == f"http://127.0.0.1:{port}"
        names = parse_checksums((tmp_path / "root" / "checksums.txt").read_text())
        assert len(names) == 3
        body = requests.get(f"{url}/{names[0].name}", timeout=10).content
        assert sha256_hex(body) == names[0].sha256
        assert json.loads(requests.get(f"{url}/_stats", timeout=10).text)["total_requests"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.parametrize("length", ["-5", "abc", "99999999999"])
def test_a_post_with_a_bad_content_length_is_refused_not_hung(
    tmp_path: Path, length: str
) -> None:

    with LoopbackOrigin(tmp_path) as srv:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
        try:
            conn.putrequest("POST", "/_reset")
            conn.putheader("Content-Length", length)
            conn.endheaders()
            assert conn.getresponse().status == 400
        finally:
            conn.close()
