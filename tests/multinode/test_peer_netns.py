"""The peer tier across network namespaces: two "hosts" joined by a veth pair, two
ranks each with torchrun's variables, node agents on each host's veth address, the
origin inside the first namespace. Needs root (``ip netns``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from distcache.testing import make_artifacts
from tests.multinode.test_netns_gloo import (  # the namespaces, ranks and origin of that test
    ADDRESSES,
    Host,
    _origin_in,
    _run_ranks,
    two_hosts,  # noqa: F401  (a fixture)
)

WORKER = Path(__file__).resolve().parent / "peer_worker.py"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2",
)


@pytest.mark.slow
def test_a_lazy_miss_crosses_hosts_once_per_job(
    two_hosts: tuple[Host, Host], tmp_path: Path  # noqa: F811
) -> None:
    made = make_artifacts(tmp_path / "mirror", 8, min_size=2_000, max_size=40_000, seed=5)
    names = tmp_path / "names.txt"  # the worker asks for the first 8 lines
    names.write_text("".join(f"{a.sha256}  {a.name}\n" for a in made))
    with _origin_in(two_hosts[0], tmp_path / "mirror", tmp_path) as url:
        (tmp_path / "origin.url").write_text(url)
        outputs = _run_ranks(two_hosts, [str(WORKER), "netns", str(tmp_path), str(names)],
                             tmp_path / "logs")
    log = "\n".join(o for _, o in outputs)
    assert [rc for rc, _ in outputs] == [0, 0, 0, 0], log
    results = [json.loads(line[len("RESULT "):]) for _, out in outputs
               for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 4, log
    assert all(r["right"] for r in results)
    # The agents listen on the veth addresses, one per host, never on loopback.
    endpoints = results[0]["endpoints"]
    assert sorted(e.rsplit(":", 1)[0] for e in endpoints) == [f"tcp://{a}" for a in ADDRESSES]
    stats = [r["stats"] for r in results]
    # Once per job, not per host (the stats say which lookups went where if not).
    assert max(r["origin"] for r in results) == len(made), stats
    assert sum(s["peer_failed"] + s["fallbacks"] for s in stats) == 0
    assert sum(s["peer"] for s in stats) >= len(made)  # bytes crossed the link from owners
