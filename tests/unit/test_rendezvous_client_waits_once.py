"""A rank that meets its rank 0 on a store waits for the store within its timeout
once: it waits for the server to listen itself and hands torch's client only what is
left, instead of letting torch's client use the whole timeout, back off and try again
(about twice the timeout, with a C++ trace for each try)."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from launch import _rendezvous
from launch._rendezvous import client_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_with_nothing_listening_torchs_client_is_never_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: made.append(a))
    port = _free_port()
    with pytest.raises(TimeoutError, match=f"nothing listened at 127.0.0.1:{port}"):
        client_store("127.0.0.1", port, 2, timedelta(seconds=0.5))
    assert made == []  # torch's client, which would try twice, was never given the wait


def test_a_store_that_comes_late_is_reached() -> None:
    port = _free_port()
    hosted: list[Any] = []

    def host() -> None:
        hosted.append(dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=30),
                                    wait_for_workers=False))

    later = threading.Timer(0.3, host)
    later.start()
    try:
        store = client_store("127.0.0.1", port, 2, timedelta(seconds=30))
        store.set("k", "v")
        later.join(30)
        assert hosted and hosted[0].get("k") == b"v"
    finally:
        later.cancel()


def test_find_store_names_the_store_nobody_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    from launch._detect import LaunchInfo

    made: list[Any] = []
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: made.append(a))
    master = _free_port() - _rendezvous.PORT_OFFSET
    info = LaunchInfo(launcher="slurm", rank=1, world_size=2, local_rank=1,
                      local_world_size=2, node_rank=0, num_nodes=1, node_id="n0",
                      master_addr="127.0.0.1", master_port=master, source="test")
    with pytest.raises(Exception, match="cannot reach the rendezvous store") as raised:
        _rendezvous.find_store(info, 0.5, environ={})
    assert "nothing listened" in str(raised.value) and made == []
