"""The CUDA IPC group probe's decisions, with the driver calls replaced by a fake GPU
per thread-rank: the real driver paths run only in scripts/gpu_check.sh."""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from distcache.comm import ThreadGroup
from distcache.errors import IpcError
from distcache.ipc import _driver, _probe


class FakeGpus:
    """Each thread-rank sees GPUs by uuid; ``fail`` maps (rank, step) -> error text."""

    def __init__(self, uuids: dict[int, bytes], peer: bool = True) -> None:
        self.uuids = uuids
        self.peer = peer
        self.fail: dict[tuple[int, str], str] = {}
        self.live: dict[int, int] = {}  # ptr -> rank that allocated it
        self.opened: list[tuple[int, bytes]] = []
        self.registered: dict[int, int] = {}  # host address -> rank that registered it
        self.rank_of: dict[int, int] = {}
        #: Ranks that made any driver call (a CUDA context, on a real GPU).
        self.touched: set[int] = set()
        self._next = 0x1000
        self._lock = threading.Lock()

    def rank(self) -> int:
        return self.rank_of[threading.get_ident()]

    def _step(self, name: str) -> None:
        why = self.fail.get((self.rank(), name))
        if why:
            raise IpcError(f"{name} failed: {why}")

    def _recorded(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            with self._lock:
                self.touched.add(self.rank())
            return fake(*args)

        return call

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def mem_alloc(ordinal: int, nbytes: int) -> int:
            self._step("alloc")
            with self._lock:
                self._next += 0x1000
                self.live[self._next] = self.rank()
                return self._next

        def mem_free(ordinal: int, ptr: int) -> None:
            with self._lock:
                del self.live[ptr]

        def ipc_handle(ordinal: int, ptr: int) -> bytes:
            self._step("export")
            return ptr.to_bytes(64, "little")

        def ipc_open(ordinal: int, handle: bytes) -> int:
            self._step("open")
            self.opened.append((self.rank(), handle))
            return int.from_bytes(handle, "little")

        def host_register(ordinal: int, address: int, nbytes: int) -> int:
            self._step("register")
            with self._lock:
                self.registered[address] = self.rank()
            return address  # the device sees the page where the host does

        def host_unregister(ordinal: int, address: int) -> None:
            with self._lock:
                del self.registered[address]

        def stream_write(ordinal: int, stream: int, address: int, value: int) -> None:
            self._step("stream")
            if (self.rank(), "lost write") not in self.fail:
                ctypes.memmove(address, value.to_bytes(4, sys.byteorder), 4)

        def visible() -> list[bytes]:
            # This rank's own GPU first (ordinal 0), then the others it can see.
            mine = self.uuids[self.rank()]
            return [mine, *sorted(u for u in set(self.uuids.values()) if u != mine)]

        fakes: dict[str, Callable[..., Any]] = {
            "device_count": lambda: 2,
            "attribute": lambda ordinal, name: 1,
            "mem_alloc": mem_alloc,
            "mem_free": mem_free,
            "ipc_handle": ipc_handle,
            "ipc_open": ipc_open,
            "ipc_close": lambda ordinal, ptr: None,
            "host_register": host_register,
            "host_unregister": host_unregister,
            "stream_write": stream_write,
            "stream_wait": lambda ordinal, stream, address, value: None,
            "stream_synchronize": lambda ordinal, stream: None,
            "device_uuid": lambda ordinal: visible()[ordinal],
            "ordinal_of": lambda uuid: visible().index(uuid) if uuid in visible() else None,
            "can_access_peer": lambda a, b: a == b or self.peer,
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(_driver, name, self._recorded(fake))
        monkeypatch.setattr(_probe, "resolve_device", lambda device: 0)
        monkeypatch.setattr(_probe.platform, "system", lambda: "Linux")
        monkeypatch.setattr(_probe.platform, "release", lambda: "6.1.0")


def _run(gpus: FakeGpus, wants: list[bool], failure: dict[int, str] | None = None,
         nodes: list[str] | None = None) -> list[str]:
    group = ThreadGroup(len(wants), nodes, timeout=30)
    out: list[Any] = [None] * len(wants)

    def rank(r: int) -> None:
        gpus.rank_of[threading.get_ident()] = r
        try:
            out[r] = _probe.agree_backend(
                group.comm(r), wants[r], None, 30, (failure or {}).get(r, "")
            )[0]
        except BaseException as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(wants))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture
def same_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpus]:
    gpus = FakeGpus({r: b"A" * 16 for r in range(3)})
    gpus.install(monkeypatch)
    yield gpus


def test_cuda_when_every_consumer_opens_the_producers_trial_handle(same_gpu: FakeGpus) -> None:
    assert _run(same_gpu, [True, False, False]) == ["cuda"] * 3
    # The two consumers opened the producer's trial export; every trial was freed.
    assert sorted(r for r, _ in same_gpu.opened) == [1, 2]
    assert same_gpu.live == {}


def test_no_cuda_pool_means_no_probe_at_all(same_gpu: FakeGpus) -> None:
    assert _run(same_gpu, [False, False, False]) == ["shm"] * 3
    assert same_gpu.opened == [] and same_gpu.live == {}


@pytest.mark.parametrize(
    ("rank", "step"),
    [(1, "open"), (0, "export"), (0, "alloc"), (0, "register"), (0, "stream")],
)
def test_one_failing_step_on_one_rank_moves_its_whole_node_to_host_memory(
    same_gpu: FakeGpus, rank: int, step: str, caplog: pytest.LogCaptureFixture
) -> None:
    same_gpu.fail[(rank, step)] = "invalid resource handle"
    with caplog.at_level(logging.WARNING, logger="distcache.ipc._probe"):
        assert _run(same_gpu, [True, False, False]) == ["shm"] * 3
    assert f"rank {rank}" in caplog.text and "invalid resource handle" in caplog.text
    assert same_gpu.live == {} and same_gpu.registered == {}


def test_the_probe_tries_stream_memory_operations_and_sees_a_lost_write(
    same_gpu: FakeGpus, caplog: pytest.LogCaptureFixture
) -> None:
    # A device that queues the write but never lands it in host memory: ordering
    # through it would wait forever, so the node shares host memory instead.
    assert _run(same_gpu, [True, False, False]) == ["cuda"] * 3
    assert same_gpu.registered == {}
    same_gpu.fail[(0, "lost write")] = "yes"
    with caplog.at_level(logging.WARNING, logger="distcache.ipc._probe"):
        assert _run(same_gpu, [True, False, False]) == ["shm"] * 3
    assert "a stream write left 0x0, not 0x5a17c0de" in caplog.text
    assert same_gpu.registered == {} and same_gpu.live == {}


# -- per node: one probe each, and one node's failure stays its own ----------------------


class CountedProbes:
    """A fake :func:`probe_cuda_ipc`: usable on the nodes in ``capable``; counts the
    calls of each rank."""

    def __init__(self, gpus: FakeGpus, nodes: list[str], capable: set[str]) -> None:
        self.gpus, self.nodes, self.capable = gpus, nodes, capable
        self.calls: list[int] = []

    def __call__(self, device: int | None = None) -> tuple[bool, str]:
        rank = self.gpus.rank()
        self.calls.append(rank)
        if self.nodes[rank] in self.capable:
            return True, ""
        return False, "no CUDA device is visible"


TWO_NODES = ["a", "a", "a", "b", "b", "b"]


@pytest.fixture
def two_nodes(monkeypatch: pytest.MonkeyPatch) -> FakeGpus:
    gpus = FakeGpus({r: (b"A" if TWO_NODES[r] == "a" else b"B") * 16 for r in range(6)})
    gpus.install(monkeypatch)
    return gpus


def test_a_node_that_fails_the_probe_uses_host_memory_and_the_other_keeps_cuda(
    two_nodes: FakeGpus, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    probes = CountedProbes(two_nodes, TWO_NODES, capable={"a"})
    monkeypatch.setattr(_probe, "probe_cuda_ipc", probes)
    # A CUDA pool on rank 1 of node a and on rank 4 of node b.
    with caplog.at_level(logging.WARNING, logger="distcache.ipc._probe"):
        got = _run(two_nodes, [False, True, False, False, True, False], nodes=TWO_NODES)
    assert got == ["cuda"] * 3 + ["shm"] * 3
    # Once per node, on its lowest rank, whether or not that rank has a CUDA pool.
    assert sorted(probes.calls) == [0, 3]
    # Node a's consumers opened its producer's trial; node b made no trial at all.
    assert sorted(r for r, _ in two_nodes.opened) == [0, 2]
    assert not two_nodes.touched & {3, 4, 5}
    assert "node b" in caplog.text and "rank 3: no CUDA device is visible" in caplog.text
    assert "node a" not in caplog.text
    assert two_nodes.live == {}


@pytest.mark.parametrize(("rank", "step"), [(5, "open"), (4, "export"), (4, "alloc")])
def test_a_failing_trial_on_one_node_leaves_the_other_on_cuda(
    two_nodes: FakeGpus, monkeypatch: pytest.MonkeyPatch, rank: int, step: str
) -> None:
    probes = CountedProbes(two_nodes, TWO_NODES, capable={"a", "b"})
    monkeypatch.setattr(_probe, "probe_cuda_ipc", probes)
    two_nodes.fail[(rank, step)] = "invalid resource handle"
    got = _run(two_nodes, [True, False, False, False, True, False], nodes=TWO_NODES)
    assert got == ["cuda"] * 3 + ["shm"] * 3
    assert sorted(probes.calls) == [0, 3]
    assert two_nodes.live == {}


def test_a_node_without_a_cuda_pool_runs_no_probe_and_makes_no_driver_call(
    two_nodes: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes = CountedProbes(two_nodes, TWO_NODES, capable={"a", "b"})
    monkeypatch.setattr(_probe, "probe_cuda_ipc", probes)
    got = _run(two_nodes, [False, False, True, False, False, False], nodes=TWO_NODES)
    assert got == ["cuda"] * 3 + ["shm"] * 3
    assert probes.calls == [0]
    assert not two_nodes.touched & {3, 4, 5}


def test_a_known_export_failure_moves_only_its_own_node(
    two_nodes: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes = CountedProbes(two_nodes, TWO_NODES, capable={"a", "b"})
    monkeypatch.setattr(_probe, "probe_cuda_ipc", probes)
    got = _run(two_nodes, [True, False, False, True, False, False], {3: "cuMemAlloc failed"},
               nodes=TWO_NODES)
    assert got == ["cuda"] * 3 + ["shm"] * 3
    assert probes.calls == [0]  # node b already knew: no probe there


def test_the_real_probe_runs_once_per_node_and_not_on_every_rank(
    two_nodes: FakeGpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = _probe.probe_cuda_ipc, []

    def counted(device: int | None = None) -> tuple[bool, str]:
        calls.append(two_nodes.rank())
        return real(device)

    monkeypatch.setattr(_probe, "probe_cuda_ipc", counted)
    got = _run(two_nodes, [True, True, True, False, False, True], nodes=TWO_NODES)
    assert got == ["cuda"] * 6
    assert sorted(calls) == [0, 3]
    # Every rank opened each trial of its node's other exporters, and only those.
    assert sorted(r for r, _ in two_nodes.opened) == [0, 0, 1, 1, 2, 2, 3, 4]
    assert two_nodes.live == {}


def test_a_pool_that_could_not_be_exported_votes_for_host_memory(same_gpu: FakeGpus) -> None:
    assert _run(same_gpu, [True, False], {0: "cuMemAlloc failed"}) == ["shm"] * 2


def test_different_gpus_without_peer_access_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = FakeGpus({0: b"A" * 16, 1: b"B" * 16}, peer=False)
    gpus.install(monkeypatch)
    assert _run(gpus, [True, False]) == ["shm"] * 2
    gpus.peer = True
    assert _run(gpus, [True, False]) == ["cuda"] * 2


def test_a_gpu_the_consumer_cannot_see_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = FakeGpus({0: b"A" * 16, 1: b"B" * 16})
    gpus.install(monkeypatch)
    monkeypatch.setattr(_driver, "ordinal_of", lambda uuid: None)
    assert _run(gpus, [True, False]) == ["shm"] * 2


def test_the_device_comes_from_the_launchers_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(_driver, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "6")
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _probe.resolve_device(None) == 2
    assert _probe.resolve_device(1) == 1


def test_probe_reports_a_missing_driver_instead_of_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> int:
        raise IpcError("the CUDA driver cannot be loaded: libcuda.so.1")

    monkeypatch.setattr(_driver, "device_count", broken)
    monkeypatch.setattr(_probe.platform, "system", lambda: "Linux")
    monkeypatch.setattr(_probe.platform, "release", lambda: "6.1.0")
    assert _probe.probe_cuda_ipc() == (
        False,
        "CUDA IPC is unusable: the CUDA driver cannot be loaded: libcuda.so.1",
    )
