"""Every public blocking call gives up on a peer that never answers, with a typed error.

Each test makes the peer absent (a thread-rank that never calls, an MPI rank that
sleeps, a lock holder that never releases, a server that accepts and never answers)
and checks the error type and that the bound was honoured by counting what happened
(attempts, collectives entered), never by timing. Each test body also runs under a
hard timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.collective import prefetch
from distcache.comm import ThreadGroup
from distcache.comm._base import Communicator
from distcache.errors import (
    CollectiveTimeout,
    CommError,
    IpcError,
    OriginError,
    PrefetchError,
)
from distcache.origins import DirOrigin, HttpOrigin
from distcache.store._pool import ArtifactPool
from tests.support.helpers import mpi_env, mpirun, run_group

pytestmark = pytest.mark.timeout(120)

_SHORT = 0.3  # seconds: every bound below; the assertions never depend on it


def absent_peer(
    size: int, body: Callable[[Communicator], Any], *, missing: int = 0, timeout: float = _SHORT
) -> tuple[ThreadGroup, list[Any]]:
    """Run ``body`` on every thread-rank but ``missing``; return each outcome
    (a value or the exception raised)."""
    group = ThreadGroup(size, timeout=timeout)
    outcomes: list[Any] = [None] * size

    def main(rank: int) -> None:
        try:
            outcomes[rank] = body(group.comm(rank))
        except BaseException as exc:
            outcomes[rank] = exc

    threads = [
        threading.Thread(target=main, args=(r,), daemon=True) for r in range(size) if r != missing
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread-rank hung"
    return group, outcomes


# -- communicators --------------------------------------------------------------------

COLLECTIVES: dict[str, Callable[[Communicator], Any]] = {
    "barrier": lambda c: c.barrier(),
    "allgather_object": lambda c: c.allgather_object(c.rank),
    "broadcast_bytes": lambda c: c.broadcast_bytes(b"x" if c.rank == 1 else None, 1),
    "split": lambda c: c.split(0),
}


@pytest.mark.parametrize("op", sorted(COLLECTIVES))
def test_thread_collective_with_a_missing_rank_raises_collective_timeout(op: str) -> None:
    group, outcomes = absent_peer(3, COLLECTIVES[op], missing=2)
    for rank in (0, 1):
        assert isinstance(outcomes[rank], CollectiveTimeout), outcomes[rank]
        assert outcomes[rank].rank == rank
    assert group.calls == [1, 1, 0]


_MPI_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from mpi4py import MPI
    from distcache.comm._mpi import MpiCommunicator
    from distcache.errors import CollectiveTimeout, CommError
    world = MPI.COMM_WORLD
    ops = ["barrier", "allgather_object", "broadcast_bytes", "split"]
    # One communicator per operation: a timed-out MPI communicator refuses reuse.
    comms = {op: MpiCommunicator(world.Dup(), timeout=1.0) for op in ops}
    done = sys.argv[1]
    if world.Get_rank() == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)  # the peer that never answers
        os._exit(0)
    calls = {
        "barrier": lambda c: c.barrier(),
        "allgather_object": lambda c: c.allgather_object(1),
        "broadcast_bytes": lambda c: c.broadcast_bytes(None, 1),
        "split": lambda c: c.split(0),
    }
    results = {}
    for op in ops:
        try:
            calls[op](comms[op])
            results[op] = "returned"
        except CollectiveTimeout as exc:
            results[op] = "CollectiveTimeout"
        try:
            comms[op].barrier(timeout=1.0)
            results[op + ":reuse"] = "returned"
        except CollectiveTimeout:
            results[op + ":reuse"] = "CollectiveTimeout"
        except CommError:
            results[op + ":reuse"] = "CommError"
    print("RESULTS " + json.dumps(results), flush=True)
    open(done, "w").close()
    os._exit(0)
    """
)


def test_mpi_collectives_with_a_sleeping_rank_raise_collective_timeout(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(_MPI_SCRIPT)
    done = tmp_path / "done"
    proc = run_group(
        [mpirun(), "-n", "2", "--oversubscribe", sys.executable, script, done],
        timeout=90,
        env=mpi_env(),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, proc.stdout + proc.stderr
    results = json.loads(lines[0][len("RESULTS ") :])
    for op in COLLECTIVES:
        assert results[op] == "CollectiveTimeout", results
        # A communicator whose collective was abandoned refuses further calls at once.
        assert results[op + ":reuse"] == "CommError", results


# -- the pool's download lock -----------------------------------------------------------


class CountingOrigin:
    def __init__(self, inner: DirOrigin) -> None:
        self.inner = inner
        self.calls = 0

    def describe(self) -> str:
        return self.inner.describe()

    def fetch(self, artifact: Artifact) -> bytes:
        self.calls += 1
        return self.inner.fetch(artifact)

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        self.calls += 1
        return self.inner.fetch_into(artifact, out)


@pytest.fixture
def lock_holder(tmp_path: Path) -> Iterator[Callable[[Path], subprocess.Popen[str]]]:
    """Start a live process that takes the flock on a path and never lets go."""
    procs: list[subprocess.Popen[str]] = []

    def start(path: Path) -> subprocess.Popen[str]:
        code = (
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(600)\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(path)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_pool_fetch_behind_a_lock_that_is_never_released_downloads_itself(
    tmp_path: Path, lock_holder: Callable[[Path], subprocess.Popen[str]]
) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    data = b"kernel bytes" * 100
    (mirror / "k.cubin").write_bytes(data)
    artifact = Artifact("k.cubin", sha256_hex(data), len(data))
    pool = ArtifactPool(tmp_path / "pool", lock_timeout=_SHORT)
    holder = lock_holder(pool.root / "locks" / f"{artifact.sha256}.lock")
    origin = CountingOrigin(DirOrigin(mirror))

    assert pool.fetch(artifact, origin) == data

    assert origin.calls == 1  # waited out the bound, then downloaded without the lock
    assert holder.poll() is None  # the holder is alive and still holds it
    assert pool.get(artifact.sha256) == data


# -- HTTP origin ------------------------------------------------------------------------


class SilentServer:
    """Accepts TCP connections and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        # A connection the kernel queued after the loop's last accept still counts.
        self.sock.setblocking(False)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                break
            self.accepted += 1
            self._conns.append(conn)
        for conn in self._conns:
            conn.close()
        self.sock.close()


def test_http_origin_against_a_server_that_never_answers_gives_up_after_its_retries() -> None:
    server = SilentServer()
    waits: list[float] = []
    try:
        origin = HttpOrigin(server.url, timeout=_SHORT, retries=2, sleep=waits.append)
        with origin, pytest.raises(OriginError) as info:
            origin.fetch(Artifact("a/k.cubin", "0" * 64, 10))
    finally:
        server.close()
    assert server.accepted == 3  # one attempt plus two retries, each cut off by the timeout
    assert len(waits) == 2
    assert "after 3 attempts" in str(info.value)


# -- the collective ----------------------------------------------------------------------


def test_prefetch_with_a_missing_rank_raises_prefetch_error_on_every_present_rank(
    tmp_path: Path,
) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    data = b"x" * 1000
    (mirror / "k.cubin").write_bytes(data)
    artifacts = [Artifact("k.cubin", sha256_hex(data), len(data))]

    def body(comm: Communicator) -> Any:
        pool = ArtifactPool(tmp_path / f"pool{comm.rank}")
        return prefetch(artifacts, comm=comm, pool=pool, origin=DirOrigin(mirror), timeout=_SHORT)

    group, outcomes = absent_peer(3, body, missing=1)
    for rank in (0, 2):
        exc = outcomes[rank]
        assert isinstance(exc, PrefetchError), exc
        assert isinstance(exc.__cause__, CollectiveTimeout)
        assert getattr(exc, "rank", None) == rank
    assert group.calls[1] == 0


class StallingOrigin:
    """An origin whose download never finishes until released (a drip-feeding CDN
    whose every read arrives just inside the read timeout looks like this)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def describe(self) -> str:
        return "stalling://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        self.calls += 1
        self.release.wait(60)
        raise OriginError("released", name=artifact.name)


def test_prefetch_whose_download_stalls_fails_on_every_rank_within_the_timeout(
    tmp_path: Path,
) -> None:
    # The downloading rank used to wait for its download for ever while its peers
    # gave up after the timeout: it hung past the bound the collective promises.
    data = b"y" * 100
    artifacts = [Artifact("stalls.cubin", sha256_hex(data), len(data))]
    origin = StallingOrigin()
    # Pools are opened before the clock starts; the downloader gives up at 3/4 of the
    # timeout, and the slack of 1.5 s lets its error reach a peer on a loaded machine.
    pools = [ArtifactPool(tmp_path / f"pool{r}") for r in range(2)]

    def body(comm: Communicator) -> Any:
        return prefetch(artifacts, comm=comm, pool=pools[comm.rank], origin=origin, timeout=6.0)

    try:
        group = ThreadGroup(2, timeout=6.0)
        outcomes: list[Any] = [None, None]

        def main(rank: int) -> None:
            try:
                outcomes[rank] = body(group.comm(rank))
            except BaseException as exc:
                outcomes[rank] = exc

        threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)  # far past the bound, far short of the stall
        assert not any(t.is_alive() for t in threads), "a rank waited for the stalled download"
    finally:
        origin.release.set()
    assert origin.calls == 1
    assert all(isinstance(o, PrefetchError) for o in outcomes), outcomes
    assert str(outcomes[0]) == str(outcomes[1])
    assert getattr(outcomes[0], "artifact", None) == "stalls.cubin"
    assert "did not finish within" in str(outcomes[0])


# -- IPC ---------------------------------------------------------------------------------


def test_ipc_exchange_with_a_missing_rank_raises_collective_timeout() -> None:
    from distcache.ipc import PoolRegistry, ShmPool

    pools: list[Any] = []

    def body(comm: Communicator) -> Any:
        pool = ShmPool(4096, name=f"nohang{comm.rank}")
        pools.append(pool)
        return PoolRegistry.exchange(comm, [pool], timeout=_SHORT)

    _group, outcomes = absent_peer(2, body, missing=1)
    try:
        assert isinstance(outcomes[0], CollectiveTimeout), outcomes[0]
    finally:
        for pool in pools:
            pool.close()
    assert not any(Path(p.path).exists() for p in pools)


def test_ipc_resolve_of_a_slot_never_marked_ready_raises_at_once() -> None:
    import dataclasses

    import torch

    from distcache.ipc import PoolRegistry, ShmPool

    with ShmPool(1 << 16, name="neverready", consumers=[1], slots=4) as pool:
        pool.bind(0, [1], "node")
        registry = PoolRegistry(1)
        registry.add(pool.descriptor())
        ref = pool.put(torch.ones(4))
        assert ref is not None
        assert torch.equal(registry.resolve(ref), torch.ones(4))
        # A slot the producer never published, and a generation it never reached.
        unused = dataclasses.replace(ref, slot=(ref.slot + 1) % pool.slots)
        future = dataclasses.replace(ref, generation=ref.generation + 1)
        for bad in (unused, future):
            with pytest.raises(IpcError, match="not"):
                registry.resolve(bad)
            with pytest.raises(IpcError):
                registry.ack(bad)
        registry.close()


def test_a_broken_mpi_style_communicator_is_reported_as_a_comm_error() -> None:
    # CommError is what a reused, abandoned communicator raises; the collective maps
    # it (like CollectiveTimeout) to PrefetchError rather than letting it escape.
    class Broken:
        rank, size, node_id, backend = 0, 2, "n", "broken"

        def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
            raise CommError("unusable after a timeout", op="reuse")

        def broadcast_bytes(self, data: Any, root: int, *, timeout: float | None = None) -> bytes:
            raise CommError("unusable after a timeout", op="reuse")

        def barrier(self, *, timeout: float | None = None) -> None:
            raise CommError("unusable after a timeout", op="reuse")

        def split(self, color: int) -> Communicator:
            raise CommError("unusable after a timeout", op="reuse")

    with pytest.raises(PrefetchError) as info:
        prefetch([], comm=Broken(), pool=_NoPool(), origin=_NoOrigin(), timeout=_SHORT)
    assert isinstance(info.value.__cause__, CommError)


class _NoPool:
    pool_id = "p" * 32

    def has(self, sha256: str) -> bool:
        return False

    def holding(self, shas: Iterable[str]) -> list[bool]:
        return [False for _ in shas]

    def get(self, sha256: str, *, trust_own: bool = False) -> bytes | None:
        return None

    def put(self, data: Any, sha256: str | None = None) -> str:
        raise AssertionError("nothing to publish")

    def download(self, artifact: Any, origin: Any) -> int:
        raise AssertionError("nothing to download")

    def batch(self, *, wait: bool = True) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def hold(self, shas: Iterable[str]) -> None:
        return None

    def remember(self, artifacts: Any) -> None:
        return None

    label = remember

    def names(self) -> dict[str, str]:
        return {}

    def journal_since(self, cursor: int = 0) -> tuple[list[str], int]:
        return [], 0


class _NoOrigin:
    def describe(self) -> str:
        return "none"

    def fetch(self, artifact: Artifact) -> bytes:
        raise AssertionError("nothing to download")
