"""FlashInfer's loader under N ranks: once per job with distcache, once per rank without.

Rank 0 serves a synthetic cubin repository on loopback and the URL is broadcast;
every rank points FlashInfer at it (``FLASHINFER_CUBINS_REPOSITORY``) and calls
FlashInfer's real ``get_artifact``. Request counts come from the server itself.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.comm._base import Communicator
from distcache.integrations import flashinfer as fi
from distcache.store._pool import ArtifactPool
from distcache.testing import make_artifacts
from distcache.testing._origin_server import LoopbackOrigin

K = 6


@pytest.fixture
def loader_module() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations raised by FlashInfer's dependencies
        import flashinfer.jit.cubin_loader as module
    return module


class Repo:
    """The loopback origin (on rank 0) and the artifact list (on every rank)."""

    def __init__(self, comm: Communicator, root: Path, count: int) -> None:
        self.comm = comm
        self.server: LoopbackOrigin | None = None
        if comm.rank == 0:
            made = make_artifacts(root / "repo", count, min_size=2_000, max_size=20_000)
            self.server = LoopbackOrigin(root / "repo")
            payload = "\n".join([self.server.url, *(f"{a.sha256} {a.name}" for a in made)])
        text = comm.broadcast_bytes(payload.encode() if comm.rank == 0 else None, 0).decode()
        url, *lines = text.split("\n")
        self.url = url
        self.artifacts = [Artifact(n, s) for s, n in (line.split(" ", 1) for line in lines)]

    def requests(self) -> int:
        """Artifact GETs the origin answered so far (collective)."""
        self.comm.barrier()
        count = self.server.total_requests if self.server is not None else 0
        return int(self.comm.broadcast_bytes(str(count).encode(), 0).decode())

    def reset(self) -> None:
        self.comm.barrier()
        if self.server is not None:
            self.server.reset()
        self.comm.barrier()

    def close(self) -> None:
        self.comm.barrier()
        if self.server is not None:
            self.server.stop()


@pytest.fixture
def repo(
    comm: Communicator, shared_tmp: Path, loader_module: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Repo]:
    the_repo = Repo(comm, shared_tmp, K)
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", the_repo.url)
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBINS_REPOSITORY", the_repo.url)
    monkeypatch.delenv("DISTCACHE_ORIGIN", raising=False)
    monkeypatch.delenv("DISTCACHE_DISABLE", raising=False)
    monkeypatch.delenv("DISTCACHE_FLASHINFER", raising=False)
    yield the_repo
    fi.uninstall()
    the_repo.close()


def digest_of(blobs: list[bytes]) -> str:
    return hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in blobs)).hexdigest()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_wrapper_fetches_each_artifact_once_per_job_flashinfer_alone_once_per_rank(
    comm: Communicator,
    shared_tmp: Path,
    repo: Repo,
    loader_module: Any,
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
) -> None:
    # FlashInfer alone, with a cache directory per rank (TensorRT-LLM's layout).
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", shared_tmp / f"own-r{comm.rank}")
    own = [loader_module.get_artifact(a.name, a.sha256) for a in repo.artifacts]
    assert all(own)
    assert repo.requests() == comm.size * K

    repo.reset()
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", shared_tmp / f"fi-r{comm.rank}")
    pool_dir = shared_tmp / ("pool" if layout == "shared" else f"pool-{comm.node_id}")
    loader = fi.install(ArtifactPool(pool_dir))
    assert loader is not None
    pooled = [loader_module.get_artifact(a.name, a.sha256) for a in repo.artifacts]
    assert repo.requests() == K

    assert pooled == own
    digests = comm.allgather_object(digest_of(pooled))
    assert len(set(digests)) == 1
    assert loader.stats.fallbacks == 0 and loader.stats.hits + loader.stats.fetched == K


@pytest.mark.mpi(min_size=2)
def test_recorded_kernels_are_prefetched_so_serving_makes_no_origin_request(
    comm: Communicator,
    shared_tmp: Path,
    repo: Repo,
    loader_module: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record = shared_tmp / "record"
    kernel_a, kernel_b = repo.artifacts[0], repo.artifacts[1]
    monkeypatch.setattr(loader_module, "FLASHINFER_CUBIN_DIR", shared_tmp / f"fi-r{comm.rank}")

    # Run 1: per-rank pools; only rank 0 serves the shapes that select A and B.
    fi.install(ArtifactPool(shared_tmp / f"run1-r{comm.rank}"), record=record)
    if comm.rank == 0:
        assert loader_module.get_artifact(kernel_a.name, kernel_a.sha256)
        assert loader_module.get_artifact(kernel_b.name, kernel_b.sha256)
    fi.uninstall()
    assert repo.requests() == 2

    # Run 2: fresh per-rank pools, warmed from the record before serving.
    repo.reset()
    pool = ArtifactPool(shared_tmp / f"run2-r{comm.rank}")
    fi.prefetch(comm=comm, pool=pool, record=record)
    assert repo.requests() == 2  # each recorded kernel once per job, not once per rank
    assert pool.has(kernel_a.sha256) and pool.has(kernel_b.sha256)

    repo.reset()
    loader = fi.install(pool)
    assert loader is not None
    last = comm.size - 1
    if comm.rank == last:
        data = loader_module.get_artifact(kernel_a.name, kernel_a.sha256)
        assert hashlib.sha256(data).hexdigest() == kernel_a.sha256
        assert loader.stats.hits == 1 and loader.stats.fetched == 0
    assert repo.requests() == 0
