"""ArtifactPool across processes: single downloader, crash safety, concurrent
publication, materialization and collection.

Every child runs in its own session under a hard deadline; on timeout the whole
process group is killed and the test fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.store._locking import FileLock
from distcache.store._pool import ArtifactPool

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 120.0

pytestmark = pytest.mark.slow

# Prepended to every child script: wait until the parent says go, so that all
# children hit the pool at the same moment.
PRELUDE = """
import hashlib, json, os, sys, time
from pathlib import Path
from distcache.artifact import Artifact
from distcache.store._pool import ArtifactPool
args = json.loads(sys.argv[1])
Path(args["ready"], str(os.getpid())).touch()
while not os.path.exists(args["go"]):
    time.sleep(0.005)
"""

COUNTING_ORIGIN = """
class CountingOrigin:
    # Counts requests in a file shared by every process; streams in two halves
    # with a pause so that other processes arrive while the download is running.
    def describe(self):
        return "counting-origin"
    def fetch_into(self, artifact, out):
        fd = os.open(args["counter"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, b"request\\n")
        os.close(fd)
        data = Path(args["source"]).read_bytes()
        out.write(data[: len(data) // 2])
        out.flush()
        if args.get("marker"):
            Path(args["marker"]).touch()
        time.sleep(args.get("pause", 0.3))
        out.write(data[len(data) // 2 :])
        return len(data)
"""


def run_children(
    tmp_path: Path,
    body: str,
    per_child: Sequence[Mapping[str, object]],
    *,
    deadline: float = DEADLINE,
) -> list[str]:
    """Run one child per entry of ``per_child`` (its JSON args), release them
    together, and return their stdout. Fails (after killing every group) when any
    child exits non-zero or the deadline passes."""
    ready = tmp_path / "ready"
    ready.mkdir(exist_ok=True)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for extra in per_child:
            args = {"ready": str(ready), "go": str(go), **extra}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", PRELUDE + body, json.dumps(args)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                )
            )
        end = time.monotonic() + deadline
        while len(os.listdir(ready)) < len(procs):
            if time.monotonic() > end or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.01)
        go.touch()
        outputs = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"child {proc.pid} exceeded {deadline}s; killed its process group")
            assert proc.returncode == 0, err.decode(errors="replace")
            outputs.append(out.decode())
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def blob(seed: int, size: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


FETCH_BODY = """
artifact = Artifact(args["name"], args["sha"], args["size"])
pool = ArtifactPool(args["root"], lock_timeout=args["lock_timeout"])
data = pool.fetch(artifact, ORIGIN)
print(hashlib.sha256(data).hexdigest(), len(data))
"""


@pytest.mark.timeout(180)
def test_sixteen_processes_fetching_one_missing_artifact_make_one_request(tmp_path: Path) -> None:
    data = blob(1, 300_000)
    source = tmp_path / "source.cubin"
    source.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    counter = tmp_path / "requests"
    args = {
        "root": str(tmp_path / "pool"),
        "name": "fmha/k.cubin",
        "sha": digest,
        "size": len(data),
        "lock_timeout": 100,
        "counter": str(counter),
        "source": str(source),
    }
    body = COUNTING_ORIGIN + "ORIGIN = CountingOrigin()\n" + FETCH_BODY
    outputs = run_children(tmp_path, body, [args] * 16)
    assert [o.split() for o in outputs] == [[digest, str(len(data))]] * 16
    assert counter.read_text().count("request") == 1
    pool = ArtifactPool(tmp_path / "pool")
    assert pool.verify().ok == 1
    assert pool.stats().tmp_files == 0
    assert pool.journal_since(0)[0] == [digest]


@pytest.mark.timeout(180)
def test_sixteen_processes_over_http_origin_make_one_request(tmp_path: Path) -> None:
    from distcache.origins import HttpOrigin  # noqa: F401  (checked to exist)
    from distcache.testing import LoopbackOrigin, make_artifacts

    (artifact,) = make_artifacts(tmp_path / "mirror", 1, seed=3)
    with LoopbackOrigin(tmp_path / "mirror", latency=0.3) as server:
        args = {
            "root": str(tmp_path / "pool"),
            "name": artifact.name,
            "sha": artifact.sha256,
            "size": artifact.size,
            "lock_timeout": 100,
        }
        body = (
            "from distcache.origins import HttpOrigin\n"
            f"ORIGIN = HttpOrigin({server.url!r}, retries=0)\n" + FETCH_BODY
        )
        outputs = run_children(tmp_path, body, [args] * 16)
        assert server.requests[artifact.name] == 1
        assert server.total_requests == 1
    assert {o.split()[0] for o in outputs} == {artifact.sha256}
    assert len(outputs) == 16


@pytest.mark.timeout(120)
def test_killed_downloader_leaves_no_object_and_next_caller_proceeds(tmp_path: Path) -> None:
    data = blob(2, 200_000)
    source = tmp_path / "source.cubin"
    source.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    marker = tmp_path / "half-written"
    args = {
        "root": str(tmp_path / "pool"),
        "name": "k.cubin",
        "sha": digest,
        "size": len(data),
        "lock_timeout": 100,
        "counter": str(tmp_path / "requests"),
        "source": str(source),
        "marker": str(marker),
        "pause": 600,
    }
    body = COUNTING_ORIGIN + "ORIGIN = CountingOrigin()\n" + FETCH_BODY
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (tmp_path / "ready").mkdir()
    (tmp_path / "go").touch()
    full = {"ready": str(tmp_path / "ready"), "go": str(tmp_path / "go"), **args}
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + body, json.dumps(full)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "downloader exited early"
            assert time.monotonic() < end, "downloader never started writing"
            time.sleep(0.01)
        pool = ArtifactPool(tmp_path / "pool", lock_timeout=600)
        lock_path = pool.root / "locks" / f"{digest}.lock"
        assert FileLock(lock_path, timeout=0).acquire() is False  # it holds the lock
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # Half the bytes sit in a temp file; nothing is visible as an object.
    assert not pool.has(digest)
    assert pool.get(digest) is None
    assert pool.stats().tmp_files == 1
    # The kernel released the dead holder's lock: with a 600 s lock timeout, this
    # returns at once (the test's own timeout is far shorter).
    origin_calls = []

    class Origin:
        def describe(self) -> str:
            return "second"

        def fetch_into(self, artifact: Artifact, out: object) -> int:
            origin_calls.append(artifact.sha256)
            out.write(data)  # type: ignore[attr-defined]
            return len(data)

    assert pool.fetch(Artifact("k.cubin", digest, len(data)), Origin()) == data
    assert origin_calls == [digest]
    assert pool.sweep(max_age=0) == 1
    assert pool.stats().tmp_files == 0


@pytest.mark.timeout(120)
def test_concurrent_put_of_one_object_publishes_it_once(tmp_path: Path) -> None:
    data = blob(3, 400_000)
    digest = hashlib.sha256(data).hexdigest()
    source = tmp_path / "source"
    source.write_bytes(data)
    body = """
pool = ArtifactPool(args["root"])
print(pool.put(Path(args["source"]).read_bytes()), pool.pool_id)
"""
    outputs = run_children(
        tmp_path, body, [{"root": str(tmp_path / "pool"), "source": str(source)}] * 8
    )
    shas = {o.split()[0] for o in outputs}
    pool_ids = {o.split()[1] for o in outputs}
    assert shas == {digest}
    assert len(pool_ids) == 1  # concurrent creators agreed on one pool id
    pool = ArtifactPool(tmp_path / "pool")
    assert pool.pool_id in pool_ids
    assert list(pool.objects()) == [digest]
    assert pool.get(digest) == data
    assert pool.stats().tmp_files == 0
    assert pool.journal_since(0)[0] == [digest]


@pytest.mark.timeout(120)
def test_concurrent_materialize_into_rank_dirs_and_one_shared_dir(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    data = blob(4, 250_000)
    digest = pool.put(data)
    shared = tmp_path / "shared"
    body = """
pool = ArtifactPool(args["root"])
artifact = Artifact("fmha//trtllm-gen/k.cubin", args["sha"])
for _ in range(20):
    mine = pool.materialize(artifact, args["mine"])
    common = pool.materialize(artifact, args["shared"])
    for path in (mine, common):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == args["sha"]
print(mine)
"""
    per_rank = [
        {
            "root": str(pool.root),
            "sha": digest,
            "mine": str(tmp_path / f"rank{r}"),
            "shared": str(shared),
        }
        for r in range(8)
    ]
    outputs = run_children(tmp_path, body, per_rank)
    assert len(outputs) == 8
    for rank in range(8):
        target = tmp_path / f"rank{rank}" / "fmha" / "trtllm-gen" / "k.cubin"
        assert target.read_bytes() == data
    assert os.listdir(shared / "fmha" / "trtllm-gen") == ["k.cubin"]  # no temp left behind


@pytest.mark.timeout(180)
def test_gc_under_concurrent_readers_never_yields_corrupt_bytes(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    blobs = [blob(100 + i, 20_000 + 1000 * i) for i in range(20)]
    digests = [pool.put(b) for b in blobs]
    stop = tmp_path / "stop"
    body = """
pool = ArtifactPool(args["root"])
hits = misses = bad = 0
while not os.path.exists(args["stop"]):
    for digest in args["digests"]:
        data = pool.get(digest)
        if data is None:
            misses += 1
        elif hashlib.sha256(data).hexdigest() == digest:
            hits += 1
        else:
            bad += 1
print(json.dumps({"hits": hits, "misses": misses, "bad": bad}))
"""
    readers = {"root": str(pool.root), "digests": digests, "stop": str(stop)}
    import threading

    collected = {"rounds": 0}

    def churn() -> None:
        # Wait for the readers to be released, then collect and republish.
        while not (tmp_path / "go").exists():
            time.sleep(0.005)
        for _ in range(8):
            pool.gc(sum(len(b) for b in blobs) // 3)
            for b in blobs:
                pool.put(b)
            collected["rounds"] += 1
        stop.touch()

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        outputs = run_children(tmp_path, body, [readers] * 3)
    finally:
        stop.touch()
        churner.join(timeout=60)
    results = [json.loads(o) for o in outputs]
    assert collected["rounds"] == 8
    assert sum(r["bad"] for r in results) == 0
    assert sum(r["hits"] for r in results) > 0
    assert pool.quarantined == 0
    assert ArtifactPool(pool.root).verify().corrupt == 0
