"""An HTTP origin in a process that forks: the child's requests are its own.

A long-lived process (an engine's server) that fetched through an ``HttpOrigin`` and
then forks workers hands each child a copy of the origin's pooled keep-alive
connections. A parent and a child sending a request each on that one socket read each
other's answers: both fail with a digest mismatch that blames the mirror. Nor may a
child back off by the parent's jitter: forked workers that all meet a 429 would all
wait the same time. Each scenario runs in a fresh interpreter (forking pytest, with
its threads, is not what is tested).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SERVER = r"""
import os, socket, sys, threading, time
from distcache.artifact import Artifact, sha256_hex
from distcache.origins import HttpOrigin

BODIES = {"/a.cubin": b"a" * 1000, "/b.cubin": b"b" * 1000}
A = Artifact("a.cubin", sha256_hex(BODIES["/a.cubin"]), 1000)
B = Artifact("b.cubin", sha256_hex(BODIES["/b.cubin"]), 1000)
listener = socket.create_server(("127.0.0.1", 0))
URL = f"http://127.0.0.1:{listener.getsockname()[1]}"
ports = []


def handle(conn, peer):
    # Keep-alive: every request of the connection is answered on it.
    reader = conn.makefile("rb")
    while True:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = reader.readline()
            if not line:
                return
            head += line
        path = head.split(b" ")[1].decode()
        ports.append(peer[1])
        if STATUS != 200:
            conn.sendall(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n")
            continue
        if path == "/b.cubin":
            os.write(write, b"B")  # tells the child its request came
            time.sleep(0.5)
        body = BODIES[path]
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def serve():
    while True:
        conn, peer = listener.accept()
        threading.Thread(target=handle, args=(conn, peer), daemon=True).start()


threading.Thread(target=serve, daemon=True).start()
"""

_CROSSED = _SERVER + r"""
STATUS = 200
origin = HttpOrigin(URL, retries=0, timeout=5)
origin.fetch(A)  # one pooled keep-alive connection
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    # The child asks for B and is gone before the answer comes (a worker killed).
    threading.Thread(target=origin.fetch, args=(B,), daemon=True).start()
    os.read(read, 1)
    os._exit(0)
os.waitpid(pid, 0)
try:
    origin.fetch(A)
    parent = "ok"
except Exception as exc:
    parent = type(exc).__name__
print(parent, len(set(ports[:2])))
origin.close()
"""

_JITTER = _SERVER + r"""
STATUS = 503
waits = []
origin = HttpOrigin(URL, retries=1, timeout=5, sleep=waits.append)
try:
    origin.fetch(A)  # the jitter's generator is made with the first retry
except Exception:
    pass
read, write = os.pipe()
pid = os.fork()
waits.clear()
try:
    origin.fetch(A)
except Exception:
    pass
if pid == 0:
    os.write(write, repr(waits).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(repr(waits), os.read(read, 1000).decode())
origin.close()
"""


def _run(script: str) -> str:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_forked_child_and_its_parent_do_not_share_a_pooled_connection() -> None:
    parent, connections = _run(_CROSSED).split()
    # The parent's first request and the child's came on two connections, and the
    # parent reads its own answer, not the one the child asked for.
    assert (parent, connections) == ("ok", "2")


def test_a_forked_child_backs_off_by_a_jitter_of_its_own() -> None:
    parent, child = _run(_JITTER).split(" ", 1)
    assert parent.startswith("[") and child.startswith("[")
    assert parent != child, "the child drew the same backoff as its parent"
