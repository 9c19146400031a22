"""Nothing accumulates: a thousand prefetches and a thousand init/close cycles leave
file descriptors, threads, ``/dev/shm`` entries and the pool's ``tmp/`` as they found
them. A leak of one descriptor or one thread per call shows up here as 1,000."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import distcache
from distcache.artifact import Artifact
from distcache.collective import prefetch
from distcache.comm import LocalCommunicator
from distcache.ipc import ShmPool
from distcache.origins import DirOrigin, HttpOrigin
from distcache.store._pool import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts

CYCLES = 1000
# Over HTTP fewer cycles suffice: a per-request leak still shows as ~100.
HTTP_CYCLES = 100
SHM_DIR = "/dev/shm"
#: The IPC pools made here are named with this process's id, and only their segments are
#: counted: another process of the host (a test run beside this one) makes its own.
SHM_PREFIX = f"distcache.hygiene-{os.getpid()}-"

pytestmark = pytest.mark.timeout(120)


def settled() -> None:
    """Wait for the flushes prefetches leave running in the background (one thread at
    a time per pool; each ends when nothing is left to flush)."""
    for thread in threading.enumerate():
        if thread.name == "distcache-flush":
            thread.join(60)


def census(pool: ArtifactPool | None = None, *, shm: bool = False) -> dict[str, object]:
    """What a leak would grow: open descriptors, live threads, this process's shm
    segments (:data:`SHM_PREFIX`, where ``shm``: the tests that make IPC pools), temp files
    (after the background flushes are done, and after a collection: a descriptor an
    earlier test left to the garbage collector would otherwise close mid-count)."""
    settled()
    gc.collect()
    found: dict[str, object] = {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": sorted(t.name for t in threading.enumerate()),
    }
    if shm:
        found["shm"] = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX))
    if pool is not None:
        found["tmp"] = sorted(os.listdir(pool.root / "tmp"))
        found["locks"] = sorted(os.listdir(pool.root / "locks"))
    return found


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[Path, list[Artifact]]]:
    root = tmp_path / "mirror"
    yield root, make_artifacts(root, 4, min_size=200, max_size=2_000, seed=7)


def evict(pool: ArtifactPool, sha: str) -> None:
    os.unlink(pool.root / "objects" / sha[:2] / sha)


def test_thousand_prefetches_with_misses_and_hits_leak_nothing(
    tmp_path: Path, mirror: tuple[Path, list[Artifact]]
) -> None:
    root, artifacts = mirror
    comm = LocalCommunicator()
    pool = ArtifactPool(tmp_path / "pool")
    origin = DirOrigin(root)
    prefetch(artifacts, comm=comm, pool=pool, origin=origin)  # warm imports and caches
    before = census(pool)
    downloads = hits = 0
    for cycle in range(CYCLES):
        if cycle % 2:  # a miss: one object gone, downloaded again
            evict(pool, artifacts[cycle % len(artifacts)].sha256)
        report = prefetch(artifacts, comm=comm, pool=pool, origin=origin)
        downloads += report.downloads
        hits += report.pool_hits
    assert census(pool) == before
    assert downloads == CYCLES // 2
    assert hits == CYCLES * len(artifacts) - CYCLES // 2


def test_prefetches_over_http_with_misses_leak_no_sockets(
    tmp_path: Path, mirror: tuple[Path, list[Artifact]]
) -> None:
    root, artifacts = mirror
    comm = LocalCommunicator()
    pool = ArtifactPool(tmp_path / "pool")
    with LoopbackOrigin(root) as server, HttpOrigin(server.url, timeout=10, retries=0) as origin:
        prefetch(artifacts, comm=comm, pool=pool, origin=origin)
        before = census(pool)
        for cycle in range(HTTP_CYCLES):
            evict(pool, artifacts[cycle % len(artifacts)].sha256)
            prefetch(artifacts, comm=comm, pool=pool, origin=origin)
        after = census(pool)
        assert server.total_requests == len(artifacts) + HTTP_CYCLES
    # The client keeps a bounded number of pooled keep-alive connections: allow that,
    # never one per request.
    assert after["threads"] == before["threads"]
    assert after["tmp"] == before["tmp"] == []
    assert isinstance(after["fds"], int) and isinstance(before["fds"], int)
    assert after["fds"] - before["fds"] <= 4


def test_thousand_init_close_cycles_with_an_ipc_exchange_leak_nothing(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    comm = LocalCommunicator()

    made = iter(range(CYCLES + 1))

    def cycle() -> None:
        shm = ShmPool(4096, slots=4, name=f"{SHM_PREFIX.removeprefix('distcache.')}{next(made)}")
        try:
            session = distcache.init(comm=comm, pool=pool, ipc_pools=[shm], integrations=())
            try:
                assert session.registry is not None
                assert not os.path.exists(shm.path)  # unlinked right after the exchange
            finally:
                session.close()
        finally:
            shm.close()

    cycle()  # warm imports (torch for the CUDA probe) before counting
    before = census(pool, shm=True)
    for _ in range(CYCLES):
        cycle()
    assert census(pool, shm=True) == before
    assert distcache.session.current() is None


# -- communicators: split() is called by every prefetch and sync ----------------------

_SPLIT_SCRIPT = """
import json, os, sys
backend = sys.argv[1]
if backend == "torch-gloo":
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from distcache.comm._torch import TorchCommunicator as Comm
else:
    from distcache.comm._mpi import MpiCommunicator as Comm
comm = Comm(timeout=30)
first = comm.split(0)
first.barrier()
fds = len(os.listdir("/proc/self/fd"))
again = [comm.split(0) for _ in range(200)]
for child in again:
    child.barrier()
grown = len(os.listdir("/proc/self/fd")) - fds
same = all(child is first for child in again)
first._broken = "a timeout"  # a broken child is never handed out again
fresh = comm.split(0)
fresh.barrier()
print("RESULT " + json.dumps({"same": same, "grown": grown, "fresh": fresh is not first}))
sys.stdout.flush()
os._exit(0)
"""


# (ids avoid the bare word "mpi": pytest-mpi would take it for its marker and skip)
@pytest.mark.parametrize("backend", ["mpi4py", "torch-gloo"])
def test_repeated_splits_reuse_one_communicator_per_partition(
    tmp_path: Path, backend: str
) -> None:
    # A process group per split leaked gloo's sockets (4 descriptors per call here)
    # on every prefetch and sync whose writers are not all ranks.
    from tests.support.helpers import mpi_env, run_group

    script = tmp_path / "split.py"
    script.write_text(_SPLIT_SCRIPT)
    proc = run_group([sys.executable, script, backend], timeout=120, env=mpi_env())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    result = json.loads(lines[0][len("RESULT ") :])
    assert result == {"same": True, "grown": 0, "fresh": True}
