"""One rank of the peer-tier tests (tests/multinode/test_peer_burst.py): FlashInfer's
real ``get_artifact`` behind ``distcache.init``, with one pool per simulated node.

``phases``: warm-up on rank 0 for set A, then every rank asks for set A; then every rank
asks for set B at once. Rank 0 reads the origin's counter between phases.
``kill``: every rank asks for set A at once; the ranks of the node listed first among
the agents SIGKILL themselves after a few lookups. ``launch``: no ``init``; the
FlashInfer wrapper comes from ``DISTCACHE_AUTOINSTALL=1`` and the agent from
``python -m launch --peers``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any


def _ask(loader_module: Any, pairs: list[list[str]]) -> tuple[bool, float]:
    """Every artifact of ``pairs`` through FlashInfer's ``get_artifact``: whether all
    were right, and the longest lookup in seconds."""
    right, longest = True, 0.0
    for sha, name in pairs:
        start = time.monotonic()
        data = loader_module.get_artifact(name, sha)
        longest = max(longest, time.monotonic() - start)
        right = right and hashlib.sha256(data).hexdigest() == sha
    return right, longest


def main(mode: str, base: Path, names_file: Path) -> int:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ["RANK"])
    if mode == "netns":  # torchrun's variables in a network namespace per "host"
        os.environ["DISTCACHE_POOL"] = str(base / f"pool-{os.environ['DISTCACHE_NODE_ID']}")
        os.environ["FLASHINFER_CUBINS_REPOSITORY"] = (base / "origin.url").read_text()
    os.environ["FLASHINFER_CUBIN_DIR"] = str(base / f"fi-{mode}-r{rank}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as loader_module

    from distcache.integrations.flashinfer import installed

    pairs = [line.split("  ", 1) for line in names_file.read_text().splitlines()]
    set_a, set_b = pairs[:32], pairs[32:64]
    url = os.environ["FLASHINFER_CUBINS_REPOSITORY"]
    result: dict[str, Any] = {"rank": rank, "node": os.environ["DISTCACHE_NODE_ID"]}
    if mode == "launch":
        right, longest = _ask(loader_module, set_a)
        loader = installed()
        assert loader is not None, "DISTCACHE_AUTOINSTALL did not install the wrapper"
        result.update(right=right, longest=longest, stats=_stats(loader))
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    import distcache
    from distcache.integrations.flashinfer import FlashInfer
    from distcache.peer import owner
    from tests.support.helpers import origin_requests as counted_requests

    if mode == "netns":
        import launch

        launch.init_process_group(backend="gloo", timeout=120)
    session = distcache.init(integrations=[FlashInfer()])
    comm = session.comm
    loader = installed()
    assert loader is not None and session._peers is not None

    def origin_requests() -> int:
        return counted_requests(comm, url)

    if mode == "phases":
        if rank == 0:
            _ask(loader_module, set_a)
        result["after_warmup"] = origin_requests()
        right_a, longest_a = _ask(loader_module, set_a)
        result["after_burst"] = origin_requests()
        right_b, longest_b = _ask(loader_module, set_b)
        result["after_at_once"] = origin_requests()
        result.update(right=right_a and right_b, longest=max(longest_a, longest_b),
                      stats=_stats(loader))
        print("RESULT " + json.dumps(result), flush=True)
        session.close()
        return 0

    if mode == "netns":  # every rank at once, over real TCP between the namespaces
        right, longest = _ask(loader_module, set_a[:8])
        result.update(right=right, longest=longest, stats=_stats(loader),
                      endpoints=session._peers.nodes, origin=origin_requests())
        print("RESULT " + json.dumps(result), flush=True)
        session.close()
        return 0

    # kill: the first agent's node dies in the middle of the burst.
    nodes = session._peers.nodes  # in rank order: the first is rank 0's node
    where = comm.allgather_object((comm.node_id, os.getpid()))
    victim = comm.node_id == where[0][0]
    result["owned_by_first"] = sum(owner(sha, nodes) == 0 for sha, _ in set_a)
    comm.barrier()
    if victim:
        print("RESULT " + json.dumps({**result, "victim": True}), flush=True)
        _ask(loader_module, set_a[:4])
        # The node dies: whichever of its ranks comes here first kills both.
        for node, pid in where:
            if node == comm.node_id and pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    right, longest = _ask(loader_module, set_a)
    result.update(right=right, longest=longest, stats=_stats(loader), victim=False)
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no collective after a peer died: MPI's teardown would wait on it


def _stats(loader: Any) -> dict[str, int]:
    keys = ("hits", "fetched", "peer", "peer_fallbacks", "peer_failed", "fallbacks")
    return {k: int(getattr(loader.stats, k)) for k in keys}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))
