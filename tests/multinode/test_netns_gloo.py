"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Two ranks run in each namespace with torchrun's variables; rank 0's namespace address
is MASTER_ADDR, so the rendezvous and gloo's traffic cross a real TCP path between
hosts instead of loopback. Needs root (``ip netns``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "launchers" / "allreduce_prog.py"
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


def test_gloo_all_reduce_across_two_namespaces(two_hosts: tuple[Host, Host]) -> None:
    procs: list[subprocess.Popen[str]] = []
    try:
        for node, host in enumerate(two_hosts):
            for local in range(2):
                env = {
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                    "PYTHONPATH": str(REPO),
                    "PYTHONDONTWRITEBYTECODE": "1",
                    "OMP_NUM_THREADS": "1",
                    "RANK": str(2 * node + local),
                    "WORLD_SIZE": "4",
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": "2",
                    "GROUP_RANK": str(node),
                    "MASTER_ADDR": two_hosts[0].address,
                    "MASTER_PORT": "29500",
                    # gloo binds to what the host name resolves to unless told otherwise.
                    "GLOO_SOCKET_IFNAME": host.ifname,
                    "DISTCACHE_NODE_ID": f"node-{node}",
                }
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", host.netns, sys.executable, str(PROGRAM)],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                        cwd=REPO,
                    )
                )
        deadline = time.monotonic() + TIMEOUT
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"ranks did not finish within {TIMEOUT}s")
            outputs.append((proc.returncode, out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = "\n".join(out for _, out in outputs)
    assert [rc for rc, _ in outputs] == [0, 0, 0, 0], log
    results = sorted(line.split()[1:] for _, out in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == [["torchrun", str(r), "4", "10"] for r in range(4)], log
