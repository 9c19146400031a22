"""distcache.init under mpirun -n 4: adopts the running world, prefetches once per job,
exchanges IPC pools once, and is idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

import distcache
from distcache.artifact import Artifact, manifest_text, parse_checksums
from distcache.comm._base import Communicator
from distcache.errors import ConfigError
from distcache.ipc import FeatureRef, ShmPool
from distcache.store import ArtifactPool
from distcache.testing import LoopbackOrigin, make_artifacts


def _origin_url(comm: Communicator, root: Path, srv_box: list[LoopbackOrigin]) -> str:
    url = b""
    if comm.rank == 0:
        srv = LoopbackOrigin(root)
        srv_box.append(srv)
        url = srv.url.encode()
    return comm.broadcast_bytes(url, 0).decode()


@pytest.mark.mpi(min_size=2)
def test_init_adopts_the_world_and_fetches_each_artifact_once(
    comm: Communicator, shared_tmp: Path
) -> None:
    origin_root = shared_tmp / "origin"
    if comm.rank == 0:
        artifacts = make_artifacts(origin_root, 8, min_size=2_000, max_size=20_000, seed=3)
        (shared_tmp / "manifest.txt").write_text(manifest_text(artifacts))
    comm.barrier()
    servers: list[LoopbackOrigin] = []
    url = _origin_url(comm, origin_root, servers)
    node = "even" if comm.rank % 2 == 0 else "odd"
    pool_dir = shared_tmp / "pools" / node
    producer = ShmPool(1 << 20)
    try:
        session = distcache.init(
            pool=pool_dir, origin=url, manifests=[shared_tmp / "manifest.txt"],
            ipc_pools=[producer], integrations=(),
        )
        # No comm was passed: init adopted the world this suite runs on.
        assert session.comm.size == comm.size
        assert session.comm.backend == comm.backend
        assert distcache.init() is session
        report = session.report
        assert report is not None and report.downloads == 8
        assert session.registry is not None
        peers = comm.size - 1
        assert sorted(session.registry.opens.values()) == [1] * peers

        # One feature from every rank to every other rank, resolved without re-mapping.
        import torch

        ref = producer.put(torch.full((4, 4), float(comm.rank)))
        assert ref is not None
        packed = session.comm.allgather_object(ref.pack())
        for owner, blob in enumerate(packed):
            if owner == comm.rank:
                continue
            peer_ref = FeatureRef.unpack(blob)
            assert float(session.registry.resolve(peer_ref)[0, 0]) == float(owner)
            session.registry.ack(peer_ref)
        assert sorted(session.registry.opens.values()) == [1] * peers
        session.comm.barrier()
        requests = servers[0].total_requests if servers else 0
        assert comm.allgather_object(requests)[0] == 8
        session.close()

        # A second launch over the same pools downloads nothing.
        again = distcache.init(pool=pool_dir, origin=url,
                               manifests=[shared_tmp / "manifest.txt"], integrations=())
        assert again is not session
        assert again.report is not None and again.report.downloads == 0
        again.close()
        requests = servers[0].total_requests if servers else 0
        assert comm.allgather_object(requests)[0] == 8
    finally:
        comm.barrier()
        producer.close()
        for srv in servers:
            srv.stop()


@pytest.mark.mpi(min_size=2)
def test_a_warm_pool_starts_every_rank_without_an_origin(
    comm: Communicator, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISTCACHE_ORIGIN", raising=False)
    monkeypatch.delenv("DISTCACHE_OFFLINE", raising=False)
    origin_root = shared_tmp / "origin"
    if comm.rank == 0:
        artifacts = make_artifacts(origin_root, 6, min_size=2_000, max_size=20_000, seed=4)
        (shared_tmp / "manifest.txt").write_text(manifest_text(artifacts))
        warm = ArtifactPool(shared_tmp / "pools" / "even")
        for a in artifacts:
            warm.put((origin_root / a.name).read_bytes(), a.sha256)
    comm.barrier()
    listed = parse_checksums((shared_tmp / "manifest.txt").read_text())
    # Even ranks share the warm pool; odd ranks start empty and receive it from them.
    pool_dir = shared_tmp / "pools" / ("even" if comm.rank % 2 == 0 else "odd")
    with distcache.init(pool=pool_dir, manifests=[shared_tmp / "manifest.txt"],
                        integrations=()) as session:
        assert session.report is not None and session.report.downloads == 0
        assert session.pool is not None
        assert all(session.pool.has(a.sha256) for a in listed)

    # What no pool holds is one error, the same on every rank, naming it.
    absent = Artifact("cubins/absent/none.cubin", "0" * 64)
    with pytest.raises(ConfigError) as caught:
        distcache.init(pool=pool_dir, manifests=[[*listed, absent]], integrations=())
    text = str(caught.value)
    assert "1 artifact(s) are in no pool and no origin is set" in text and absent.name in text
    assert len(set(comm.allgather_object(text))) == 1
