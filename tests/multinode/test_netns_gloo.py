"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Two ranks run in each namespace with torchrun's variables; rank 0's namespace address
is MASTER_ADDR, so the rendezvous and gloo's traffic cross a real TCP path between
hosts instead of loopback. The prefetch test also runs the artifact origin inside the
first namespace, bound to its veth address, so ranks of the second "host" download
across the link too. Needs root (``ip netns``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from distcache.store._pool import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.helpers import kill_group

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "launchers" / "allreduce_prog.py"
WORKER = REPO / "tests" / "multinode" / "prefetch_worker.py"
ORIGIN_SERVER = REPO / "scripts" / "origin_server.py"
# A /30 used only inside namespaces this test creates.
ADDRESSES = ("10.213.7.1", "10.213.7.2")
TIMEOUT = 120.0

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2",
)


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    address: str


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


@pytest.fixture
def two_hosts(request: pytest.FixtureRequest) -> Iterator[tuple[Host, Host]]:
    tag = uuid.uuid4().hex[:6]
    hosts = (
        Host(f"dc-{tag}-a", f"dva{tag}", ADDRESSES[0]),
        Host(f"dc-{tag}-b", f"dvb{tag}", ADDRESSES[1]),
    )

    def cleanup() -> None:
        # Deleting a namespace also deletes the veth end inside it.
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=30)

    request.addfinalizer(cleanup)
    for host in hosts:
        _ip("netns", "add", host.netns)
    _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
    for host in hosts:
        _ip("link", "set", host.ifname, "netns", host.netns)
        _ip("-n", host.netns, "addr", "add", f"{host.address}/30", "dev", host.ifname)
        _ip("-n", host.netns, "link", "set", host.ifname, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
    yield hosts


def _rank_env(hosts: tuple[Host, Host], node: int, local: int) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO),
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "RANK": str(2 * node + local),
        "WORLD_SIZE": "4",
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": str(node),
        "MASTER_ADDR": hosts[0].address,
        "MASTER_PORT": "29500",
        # gloo binds to what the host name resolves to unless told otherwise.
        "GLOO_SOCKET_IFNAME": hosts[node].ifname,
        "DISTCACHE_NODE_ID": f"node-{node}",
    }


def _run_ranks(hosts: tuple[Host, Host], argv: Sequence[str], logs: Path) -> list[tuple[int, str]]:
    """Two ranks of ``argv`` in each namespace; their exit codes and output, by rank.

    Every rank is its own process group, killed if the ranks are not all done within
    ``TIMEOUT`` (which fails the test). Output goes to files: a pipe nobody reads
    while another rank is awaited could fill and stall its writer.
    """
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for node, host in enumerate(hosts):
            for local in range(2):
                rank = 2 * node + local
                with (logs / f"rank{rank}.log").open("wb") as out:
                    procs.append(
                        subprocess.Popen(
                            ["ip", "netns", "exec", host.netns, sys.executable, *argv],
                            env=_rank_env(hosts, node, local),
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                            cwd=REPO,
                        )
                    )
        deadline = time.monotonic() + TIMEOUT
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"ranks did not finish within {TIMEOUT}s:\n{_logs(logs)}")
    finally:
        for proc in procs:
            kill_group(proc)
    return [
        (proc.returncode, (logs / f"rank{rank}.log").read_text(errors="replace"))
        for rank, proc in enumerate(procs)
    ]


def _logs(logs: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))


def test_gloo_all_reduce_across_two_namespaces(
    two_hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    outputs = _run_ranks(two_hosts, [str(PROGRAM)], tmp_path / "logs")
    log = "\n".join(out for _, out in outputs)
    assert [rc for rc, _ in outputs] == [0, 0, 0, 0], log
    results = sorted(
        line.split()[1:]
        for _, out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT")
    )
    assert results == [["torchrun", str(r), "4", "10"] for r in range(4)], log


@contextlib.contextmanager
def _origin_in(host: Host, root: Path, work: Path) -> Iterator[str]:
    """The loopback origin serving ``root``, run inside ``host``'s namespace and bound
    to its veth address; yields its URL. Its process group is killed on exit."""
    port_file = work / "origin.port"
    with (work / "origin.log").open("wb") as out:
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                sys.executable,
                str(ORIGIN_SERVER),
                "--root",
                str(root),
                "--host",
                host.address,
                "--port-file",
                str(port_file),
            ],
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "PYTHONPATH": str(REPO),
                "PYTHONDONTWRITEBYTECODE": "1",
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the origin did not start:\n{(work / 'origin.log').read_text()}")
            time.sleep(0.05)
        yield f"http://{host.address}:{int(port_file.read_text())}"
    finally:
        kill_group(proc)


def test_prefetch_across_two_namespaces_fetches_each_artifact_once_per_job(
    two_hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    k = 6
    artifacts = make_artifacts(tmp_path / "mirror", k, min_size=2_000, max_size=40_000, seed=3)
    total = sum(a.size or 0 for a in artifacts)
    shas = sorted(a.sha256 for a in artifacts)
    out = tmp_path / "out"
    with _origin_in(two_hosts[0], tmp_path / "mirror", tmp_path) as url:
        outputs = _run_ranks(
            two_hosts,
            [
                str(WORKER),
                "--comm",
                "torch",
                "--pools",
                str(tmp_path / "pools"),
                "--layout",
                "node",
                "--origin",
                url,
                "--manifest",
                str(tmp_path / "mirror" / "checksums.txt"),
                "--out",
                str(out),
            ],
            tmp_path / "logs",
        )
    log = "\n".join(o for _, o in outputs)
    assert [rc for rc, _ in outputs] == [0, 0, 0, 0], log
    records: list[dict[str, Any]] = [
        json.loads((out / f"rank{r}.json").read_text()) for r in range(4)
    ]
    assert [(r["node_id"], r["backend"]) for r in records] == [
        ("node-0", "gloo"),
        ("node-0", "gloo"),
        ("node-1", "gloo"),
        ("node-1", "gloo"),
    ]
    # Counted by the origin itself (read by rank 0 after every rank finished).
    stats = records[0]["origin_stats"]
    assert stats["total_requests"] == k
    assert stats["requests"] == {a.name: 1 for a in artifacts}
    reports = [r["prefetch"]["report"] for r in records]
    assert all(r["prefetch"]["error"] is None for r in records), records
    assert all({**rep, "seconds": None} == {**reports[0], "seconds": None} for rep in reports)
    report = reports[0]
    assert report["downloads"] == k and report["pools"] == 2 and report["writers"] == [0, 2]
    assert report["objects_published"] == 2 * k
    # Both "hosts" downloaded, and what each fetched crossed the link once.
    assert {d // 2 for d in report["downloaders"]} == {0, 1}
    assert report["received_bytes"] == total and report["discarded_bytes"] == 0
    for node in ("node-0", "node-1"):
        pool = ArtifactPool(tmp_path / "pools" / node)
        assert sorted(pool.objects()) == shas
        assert sorted(pool.journal_since(0)[0]) == shas
        assert pool.names() == {a.name: a.sha256 for a in artifacts}
        checked = pool.verify()
        assert (checked.ok, checked.corrupt) == (k, 0)
