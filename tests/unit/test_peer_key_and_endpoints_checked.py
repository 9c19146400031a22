"""What a process trusts of its node's agent and of the other ranks' endpoints.

- The key beside the agent's socket (``<socket>.key``) is used only when it is this
  user's own regular file, readable by nobody else, of a key's length, and not a
  symlink: in a group-writable pool another user could put a key of their own there.
- A Unix socket is dialled only when this user listens on it: another user's socket
  renamed over the agent's makes the hop fail as an unreachable agent does, never a
  lookup final, even when its answer is signed.
- A rank's malformed endpoint entry is a ``WireError`` naming that rank, not a raw
  ``ValueError``/``TypeError`` or a value coerced to a string and dialled later.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import select
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.errors import ArtifactNotFound, WireError
from distcache.peer import _client, _tier
from distcache.peer._auth import HEADER_ANSWER, derive_key, sign_answer
from distcache.peer._hosting import Starting

KEY = derive_key(b"k" * 32)
#: The uid another user's files and processes take here ("nobody").
OTHER_UID = 65534
ARTIFACT = Artifact("kernels/x.cubin", hashlib.sha256(b"real bytes").hexdigest())

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: it makes files and a process of another uid")


@pytest.fixture
def from_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``DISTCACHE_PEERS`` set to a socket path, with nothing attached or remembered."""
    monkeypatch.setattr(_tier, "_from_env", {})
    monkeypatch.setattr(_tier, "_attached", None)

    def use(sock: Path) -> None:
        monkeypatch.setenv("DISTCACHE_PEERS", str(sock))

    return use


def _key_file(sock: Path, key: bytes = KEY, mode: int = 0o600) -> Path:
    path = _tier.key_path(sock)
    path.write_bytes(key)
    os.chmod(path, mode)
    return path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --- the key file --------------------------------------------------------------------


def test_this_users_own_0600_key_gives_a_tier(
    tmp_path: Path, from_env: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    sock = tmp_path / "agent.sock"
    _key_file(sock)
    from_env(sock)
    tier = _tier.current()
    assert tier is not None and tier.key == KEY and tier.endpoint == f"unix:{sock}"
    assert _warnings(caplog) == []


@pytest.mark.parametrize("case", ["other-uid", "group-readable", "symlink", "short"])
def test_a_key_file_not_this_users_alone_gives_no_tier(
    tmp_path: Path, from_env: Any, caplog: pytest.LogCaptureFixture, case: str,
) -> None:
    caplog.set_level(logging.WARNING)
    sock = tmp_path / "agent.sock"
    if case == "other-uid":
        if os.geteuid() != 0:
            pytest.skip("needs root: it makes a key file of another uid")
        os.chown(_key_file(sock), OTHER_UID, -1)
    elif case == "group-readable":
        _key_file(sock, mode=0o640)
    elif case == "symlink":  # a link to a genuine key of this user's is not followed
        genuine = _key_file(tmp_path / "genuine.sock")
        _tier.key_path(sock).symlink_to(genuine)
    else:
        _key_file(sock, key=KEY[:16])
    from_env(sock)
    assert _tier.current() is None
    said = _warnings(caplog)
    assert len(said) == 1 and "key is not used" in said[0] and "origin" in said[0]
    assert {"other-uid": "owned by uid", "group-readable": "mode 0640",
            "symlink": "symlink", "short": "16 bytes"}[case] in said[0]
    assert _tier.current() is None and len(_warnings(caplog)) == 1  # said once


# --- a socket another user listens on ------------------------------------------------


def _answer_not_at_origin(server: socket.socket, ready: int) -> None:
    """In a child process of another uid: listen, say so on ``ready``, then answer each
    request with a 404 not-at-origin signed under this job's key (the worst case: a
    listener that holds it), until the test stops it (or 20 s pass)."""
    server.listen(4)  # the listener's uid is the one its listen() ran as
    os.write(ready, b"x")
    server.settimeout(20)
    while True:
        conn, _ = server.accept()
        conn.settimeout(20)
        head = b""
        while b"\r\n\r\n" not in head and (got := conn.recv(65536)):
            head += got
        lines = head.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
        request = dict(line.split(": ", 1) for line in lines if ": " in line)
        reason = _client.NOT_AT_ORIGIN
        with contextlib.suppress(OSError):  # an asker that hung up unasked
            conn.sendall((f"HTTP/1.1 404 Not Found\r\n{_client.HEADER_REASON}: {reason}\r\n"
                          f"{HEADER_ANSWER}: {sign_answer(KEY, request, 404, reason)}\r\n"
                          "Content-Length: 0\r\nConnection: close\r\n\r\n").encode())
        conn.close()


def _serve_as(uid: int, path: Path) -> int:
    """A child process listening on ``path`` as ``uid``; its pid."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o777)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test run
        try:
            os.close(ready_r)
            os.setgid(uid)
            os.setuid(uid)
            _answer_not_at_origin(server, ready_w)
        finally:
            os._exit(0)
    server.close()
    os.close(ready_w)
    try:  # listening before anyone dials (else a refusal would pass for the check)
        readable, _, _ = select.select([ready_r], [], [], 10)
        if not (readable and os.read(ready_r, 1) == b"x"):
            _reap(pid)
            pytest.fail("the listener of another uid did not start")
    finally:
        os.close(ready_r)
    return pid


def _reap(pid: int) -> None:
    """Stop the child (it answered already, or was never asked) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


@needs_root
def test_another_users_socket_makes_the_hop_fail_never_the_lookup_final(
    tmp_path: Path, from_env: Any,
) -> None:
    sock = tmp_path / "agent.sock"
    _key_file(sock)  # the genuine key: this user's, 0600
    pid = _serve_as(OTHER_UID, sock)
    try:
        from_env(sock)
        before = _tier.counts["failed"]
        assert _tier.lookup(ARTIFACT) is None  # as an unreachable agent: not final
        assert _tier.counts["failed"] == before + 1
        with pytest.raises(_client.PeerError) as caught:
            _client.request(f"unix:{sock}", KEY, "/v1/objects/x", timeout=5.0)
        assert caught.value.status is None and "uid 65534" in str(caught.value)
    finally:
        _reap(pid)


@needs_root
def test_this_users_own_socket_is_dialled(tmp_path: Path) -> None:
    # The same signed answer from a listener of this uid is final: the check above is
    # the listener's uid, nothing else.
    sock = tmp_path / "agent.sock"
    pid = _serve_as(os.geteuid(), sock)
    try:
        with pytest.raises(ArtifactNotFound):
            _tier.lookup(ARTIFACT, _tier.Tier(f"unix:{sock}", KEY, 5.0))
    finally:
        _reap(pid)


# --- the other ranks' endpoint entries -----------------------------------------------


class _Gather:
    """An all-gather as rank 1 of 3 sees it: rank 2 sends ``forged``."""

    def __init__(self, forged: object) -> None:
        self.rank, self.size, self.node_id, self.forged = 1, 3, "node-b", forged

    def allgather_object(self, obj: object, *, timeout: float | None = None) -> object:
        return [("node-a", "tcp://10.0.0.1:5000", ""), obj, self.forged]


FORGED = [("node-c", "tcp://10.0.0.3:5000"), 7, ("node-c", 5, None)]


@pytest.mark.parametrize("forged", FORGED, ids=repr)
def test_a_malformed_entry_in_finish_is_a_wire_error_naming_its_rank(forged: object) -> None:
    starting = Starting(_Gather(forged), KEY, 5.0, None)  # type: ignore[arg-type]
    with pytest.raises(WireError, match=r"sent by rank 2/3 are malformed") as caught:
        starting.finish()
    assert caught.value.peer == 2 and caught.value.rank == 1


@pytest.mark.parametrize("forged", FORGED, ids=repr)
def test_a_malformed_entry_among_leaders_is_a_wire_error_naming_its_rank(
    forged: object,
) -> None:
    starting = Starting(_Gather(forged), KEY, 5.0, None)  # type: ignore[arg-type]
    with pytest.raises(WireError, match=r"sent by rank 2/3 are malformed") as caught:
        starting.among_leaders(_Gather(forged))  # type: ignore[arg-type]
    assert caught.value.peer == 2


def test_well_formed_entries_pass_as_tuples() -> None:
    entries = [("node-a", "tcp://10.0.0.1:5000", ""), ["node-c", "tcp://10.0.0.3:5000", ""]]

    class Leaders(_Gather):
        def allgather_object(self, obj: object, *, timeout: float | None = None) -> object:
            return entries

    starting = Starting(Leaders(None), KEY, 5.0, None)  # type: ignore[arg-type]
    assert starting.among_leaders(Leaders(None)) == [  # type: ignore[arg-type]
        ("node-a", "tcp://10.0.0.1:5000", ""), ("node-c", "tcp://10.0.0.3:5000", "")]
