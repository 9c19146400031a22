"""Whether the group can share GPU pools with CUDA IPC, tested the way it would fail.

:func:`probe_cuda_ipc` is what one process can check alone (platform, driver, device,
stream memory operations, host registration, a trial export). :func:`agree_backend`
is the collective at exchange: every rank that will produce a CUDA pool exports a
small trial allocation, every other rank of its node checks peer access between the
two devices and opens and closes that trial handle, and the group uses CUDA IPC only
if every one of those steps worked on every rank. Otherwise the whole group shares
host memory, and the log says which rank failed which step, so no request ever meets
an unusable handle (e.g. WSL2's "invalid resource handle", SGLang issue 35385).
"""

from __future__ import annotations

import logging
import platform

from distcache.comm._base import Communicator
from distcache.errors import IpcError
from distcache.ipc import _driver as drv

log = logging.getLogger(__name__)

_TRIAL_BYTES = 1 << 16


def resolve_device(device: int | None) -> int:
    """The CUDA device this process maps pools on: ``device``; else the current device
    when the engine has initialised CUDA; else the launcher's local rank (so that
    ranks of one node do not all map on GPU 0), modulo the visible devices."""
    if device is not None:
        return device
    import torch

    if torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    import launch

    try:
        local = launch.detect().local_rank or 0
    except Exception:  # conflicting launcher variables: the default device it is
        local = 0
    count = drv.device_count()
    return local % count if count else 0


def probe_cuda_ipc(device: int | None = None) -> tuple[bool, str]:
    """Whether this process can use CUDA IPC: ``(usable, reason if not)``.

    Checks the platform, the driver, the device, stream memory operations and host
    registration, and exports a trial allocation. Never raises.
    """
    if platform.system() != "Linux":
        return False, f"CUDA IPC is only supported on Linux, not {platform.system()}"
    if "microsoft" in platform.release().lower():
        return False, "CUDA IPC handles are not usable under WSL2"
    try:
        count = drv.device_count()
        if count == 0:
            return False, "no CUDA device is visible"
        ordinal = resolve_device(device)
        if not 0 <= ordinal < count:
            return False, f"device {ordinal} does not exist ({count} visible)"
        for name in ("CAN_USE_STREAM_MEM_OPS_V1", "CAN_MAP_HOST_MEMORY", "HOST_REGISTER_SUPPORTED"):
            if not drv.attribute(ordinal, f"CU_DEVICE_ATTRIBUTE_{name}"):
                return False, f"cuda:{ordinal} lacks {name.lower()}"
        ptr = drv.mem_alloc(ordinal, _TRIAL_BYTES)
        try:
            drv.ipc_handle(ordinal, ptr)
        finally:
            drv.mem_free(ordinal, ptr)
    except Exception as exc:  # a broken driver must be a vote, not a crash
        return False, f"CUDA IPC is unusable: {exc}"
    return True, ""


def _export(device: int | None) -> tuple[str, bytes, bytes, int]:
    """Probe, and export a trial allocation: (failure or "", uuid, handle, ptr)."""
    usable, reason = probe_cuda_ipc(device)
    if not usable:
        return reason, b"", b"", 0
    try:
        ordinal = resolve_device(device)
        ptr = drv.mem_alloc(ordinal, _TRIAL_BYTES)
        return "", drv.device_uuid(ordinal), drv.ipc_handle(ordinal, ptr), ptr
    except Exception as exc:
        return f"trial export failed: {exc}", b"", b"", 0


def _try_open(device: int | None, uuid: bytes, handle: bytes) -> str:
    """Open and close a peer's trial handle; "" on success, else what failed."""
    try:
        ordinal = resolve_device(device)
        if drv.device_uuid(ordinal) != uuid:
            peer = drv.ordinal_of(uuid)
            if peer is None:
                return f"cuda:{ordinal} cannot see the producer's GPU {uuid.hex()}"
            if not drv.can_access_peer(ordinal, peer):
                return f"cuda:{ordinal} has no peer access to cuda:{peer}"
        ptr = drv.ipc_open(ordinal, handle)
        drv.ipc_close(ordinal, ptr)
    except Exception as exc:
        return f"trial open failed: {exc}"
    return ""


def agree_backend(
    comm: Communicator,
    wants_cuda: bool,
    device: int | None,
    timeout: float | None,
    failure: str = "",
) -> tuple[str, list[str]]:
    """Collective: ``("cuda" | "shm", node id of every rank)``; see the module doc.
    ``failure`` is a reason this rank already knows CUDA IPC cannot work (a pool
    that could not be exported)."""
    votes = comm.allgather_object((comm.node_id, wants_cuda), timeout=timeout)
    nodes = [node for node, _ in votes]
    exporters = [rank for rank, (_, wants) in enumerate(votes) if wants]
    if not exporters:
        return "shm", nodes
    reason, uuid, handle, ptr = (failure, b"", b"", 0) if failure else _export(device)
    try:
        trials = comm.allgather_object((reason, uuid, handle), timeout=timeout)
        failures = [(r, t[0]) for r, t in enumerate(trials) if t[0]]
        mine = ""
        if not failures:
            for rank in exporters:
                if rank != comm.rank and nodes[rank] == nodes[comm.rank]:
                    _, peer_uuid, peer_handle = trials[rank]
                    mine = _try_open(device, peer_uuid, peer_handle) or mine
        opened = comm.allgather_object(mine, timeout=timeout)
        failures += [(r, why) for r, why in enumerate(opened) if why]
    finally:
        if ptr:
            # Every rank closed the trial mapping before the last all-gather returned.
            _free_quietly(device, ptr)
    if failures:
        log.warning(
            "CUDA IPC is unusable for this group (%s); every pool is shared through host "
            "shared memory instead",
            "; ".join(f"rank {r}: {why}" for r, why in failures),
        )
        return "shm", nodes
    return "cuda", nodes


def _free_quietly(device: int | None, ptr: int) -> None:
    try:
        drv.mem_free(resolve_device(device), ptr)
    except IpcError as exc:
        log.warning("freeing the CUDA IPC trial allocation failed: %s", exc)
