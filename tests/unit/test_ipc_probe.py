"""The CUDA IPC group probe's decisions, with the driver calls replaced by a fake GPU
per thread-rank: the real driver paths run only in scripts/gpu_check.sh."""

from __future__ import annotations

import logging
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
        self.rank_of: dict[int, int] = {}
        self._next = 0x1000
        self._lock = threading.Lock()

    def rank(self) -> int:
        return self.rank_of[threading.get_ident()]

    def _step(self, name: str) -> None:
        why = self.fail.get((self.rank(), name))
        if why:
            raise IpcError(f"{name} failed: {why}")

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
            "device_uuid": lambda ordinal: visible()[ordinal],
            "ordinal_of": lambda uuid: visible().index(uuid) if uuid in visible() else None,
            "can_access_peer": lambda a, b: a == b or self.peer,
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(_driver, name, fake)
        monkeypatch.setattr(_probe, "resolve_device", lambda device: 0)
        monkeypatch.setattr(_probe.platform, "system", lambda: "Linux")
        monkeypatch.setattr(_probe.platform, "release", lambda: "6.1.0")


def _run(gpus: FakeGpus, wants: list[bool], failure: dict[int, str] | None = None) -> list[str]:
    group = ThreadGroup(len(wants), timeout=30)
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


@pytest.mark.parametrize(("rank", "step"), [(1, "open"), (0, "export"), (2, "alloc")])
def test_one_failing_step_on_one_rank_moves_the_whole_group_to_host_memory(
    same_gpu: FakeGpus, rank: int, step: str, caplog: pytest.LogCaptureFixture
) -> None:
    same_gpu.fail[(rank, step)] = "invalid resource handle"
    with caplog.at_level(logging.WARNING, logger="distcache.ipc._probe"):
        assert _run(same_gpu, [True, False, False]) == ["shm"] * 3
    assert f"rank {rank}" in caplog.text and "invalid resource handle" in caplog.text
    assert same_gpu.live == {}


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
