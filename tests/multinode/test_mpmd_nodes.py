"""Two "nodes" on one machine: an MPMD ``mpirun`` launch in which each application
context sets its own ``DISTCACHE_NODE_ID``, driven from plain pytest."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

PROGRAM = textwrap.dedent(
    """
    import json
    import sys

    import distcache.comm
    from distcache.comm._mpi import MpiCommunicator

    world = distcache.comm.auto(timeout=60)
    assert isinstance(world, MpiCommunicator), world
    nodes = world.allgather_object(world.node_id)
    color = sorted(set(nodes)).index(world.node_id)
    node = world.split(color)
    node_members = node.allgather_object(world.rank)
    # The last rank (on node "b") sends to every rank of both nodes, in small chunks.
    small = MpiCommunicator(world.mpi_comm, timeout=60, chunk_bytes=1000)
    root = world.size - 1
    sent = bytes(range(256)) * 20
    got = small.broadcast_bytes(sent if world.rank == root else None, root)
    # Each node's leader sends within its own node.
    local = node.broadcast_bytes(world.node_id.encode() * 3 if node.rank == 0 else None, 0)
    world.barrier()
    print("RESULT " + json.dumps({
        "rank": world.rank,
        "size": world.size,
        "node_id": world.node_id,
        "nodes": nodes,
        "node_rank": node.rank,
        "node_size": node.size,
        "node_members": node_members,
        "cross_node_ok": got == sent,
        "chunks": small.chunk_messages,
        "local": local.decode(),
    }), flush=True)
    """
)


def _results(proc: CompletedProcess[str]) -> list[dict[str, object]]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return sorted((json.loads(ln[len("RESULT ") :]) for ln in lines), key=lambda r: r["rank"])


def test_mpmd_launch_gives_two_nodes_of_two_ranks(
    tmp_path: Path, run_mpmd: Callable[..., CompletedProcess[str]]
) -> None:
    prog = tmp_path / "nodes_prog.py"
    prog.write_text(PROGRAM)
    argv = [sys.executable, str(prog)]
    proc = run_mpmd([(2, {"DISTCACHE_NODE_ID": "a"}, argv), (2, {"DISTCACHE_NODE_ID": "b"}, argv)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(proc)
    assert [r["rank"] for r in results] == [0, 1, 2, 3], proc.stdout
    for r in results:
        assert r["size"] == 4
        assert r["nodes"] == ["a", "a", "b", "b"]
        assert r["node_size"] == 2
        assert r["cross_node_ok"] is True
        assert r["chunks"] == 6  # 5120 bytes in 1000-byte chunks
        assert r["local"] == str(r["node_id"]) * 3
    assert [r["node_id"] for r in results] == ["a", "a", "b", "b"]
    assert [r["node_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["node_members"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
