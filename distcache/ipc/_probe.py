"""Whether a node's ranks can share GPU pools with CUDA IPC, tested the way it would fail.

:func:`probe_cuda_ipc` is what one process can check alone (platform, driver, device,
stream memory operations, host registration, a trial export). :func:`agree_backend`
is the collective at exchange, decided per node because pools are node-local: on each
node that has a CUDA pool, its lowest rank runs the probe (once for the node; no other
rank creates a CUDA context to vote), then every rank that will produce a CUDA pool
exports a small trial allocation, every other rank of its node checks peer access
between the two devices and opens and closes that trial handle, and the node uses
CUDA IPC only if each of those steps worked on each of its ranks. Otherwise that node
shares host memory, and its log says which rank failed which step, so no request
ever meets an unusable handle (e.g. WSL2's "invalid resource handle", SGLang issue
35385); another node's failure never moves this one.
"""

from __future__ import annotations

import mmap
import platform
import sys
from typing import Any

from distcache._log import get_logger
from distcache.comm._base import Communicator
from distcache.errors import IpcError, WireError
from distcache.ipc import _driver as drv

log = get_logger(__name__)

_TRIAL_BYTES = 1 << 16
_TRIAL_WORD = 0x5A17C0DE


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
        for name in ("CAN_MAP_HOST_MEMORY", "HOST_REGISTER_SUPPORTED"):
            if not drv.attribute(ordinal, f"CU_DEVICE_ATTRIBUTE_{name}"):
                return False, f"cuda:{ordinal} lacks {name.lower()}"
        failed = _trial_stream_ops(ordinal)
        if failed:
            return False, f"cuda:{ordinal}: {failed}"
        ptr = drv.mem_alloc(ordinal, _TRIAL_BYTES)
        try:
            drv.ipc_handle(ordinal, ptr)
        finally:
            drv.mem_free(ordinal, ptr)
    except Exception as exc:  # a broken driver must be a vote, not a crash
        return False, f"CUDA IPC is unusable: {exc}"
    return True, ""


def _trial_stream_ops(ordinal: int) -> str:
    """Write and wait on a registered host word from the device's stream, the way
    the pools order their slots; "" when both work, else what failed.

    Tried rather than read from an attribute: the driver's
    ``CAN_USE_STREAM_MEM_OPS_V1`` describes the legacy operations (off unless the
    kernel module enables them), not the ones the bindings call, which every
    current driver has.
    """
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        address = drv.buffer_address(page)
        try:
            device_address = drv.host_register(ordinal, address, mmap.PAGESIZE)
        except Exception as exc:
            return f"host registration failed: {exc}"
        try:
            drv.stream_write(ordinal, 0, device_address, _TRIAL_WORD)
            drv.stream_synchronize(ordinal, 0)
            seen = int.from_bytes(page[:4], sys.byteorder)
            if seen != _TRIAL_WORD:
                return f"a stream write left {seen:#x}, not {_TRIAL_WORD:#x}"
            drv.stream_wait(ordinal, 0, device_address, _TRIAL_WORD)
            drv.stream_synchronize(ordinal, 0)
        except Exception as exc:
            return f"stream memory operations failed: {exc}"
        finally:
            drv.host_unregister(ordinal, address)
    finally:
        page.close()
    return ""


def _export(device: int | None) -> tuple[str, bytes, bytes, int]:
    """Export a trial allocation: (failure or "", uuid, handle, ptr)."""
    try:
        ordinal = resolve_device(device)
        ptr = drv.mem_alloc(ordinal, _TRIAL_BYTES)
    except Exception as exc:
        return f"trial allocation failed: {exc}", b"", b"", 0
    try:
        return "", drv.device_uuid(ordinal), drv.ipc_handle(ordinal, ptr), ptr
    except Exception as exc:
        _free_quietly(device, ptr)
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
    """Collective: ``("cuda" | "shm" for this rank's node, node id of every rank)``;
    see the module doc. ``failure`` is a reason this rank already knows CUDA IPC
    cannot work (a pool that could not be exported).

    Every rank takes part in every round, so the rounds stay in step; each node's
    answer depends only on what its own ranks report.

    Raises:
        WireError: a rank's vote or trial export is malformed (on every rank alike).
    """
    votes = _checked(comm.allgather_object((comm.node_id, wants_cuda, failure),
                                           timeout=timeout), (str, bool, str), "vote")
    nodes = [node for node, _, _ in votes]
    here = nodes[comm.rank]
    exporters = [rank for rank, (_, wants, _) in enumerate(votes) if wants]
    # node -> (rank, what failed) for each node that cannot use CUDA IPC.
    failed: dict[str, list[tuple[int, str]]] = {}
    for rank, (node, wants, why) in enumerate(votes):
        if wants and why:
            failed.setdefault(node, []).append((rank, why))
    viable = {nodes[r] for r in exporters} - set(failed)
    if viable:
        _probe_nodes(comm, nodes, viable, failed, device, timeout)
    if viable - set(failed):
        _trial_nodes(comm, nodes, exporters, failed, device, timeout)
    if here in failed:
        log.warning(
            "CUDA IPC is unusable on node %s (%s); its pools are shared through host "
            "shared memory instead",
            here, "; ".join(f"rank {r}: {why}" for r, why in failed[here]),
        )
        return "shm", nodes
    return ("cuda" if here in viable else "shm"), nodes


def _checked(gathered: list[Any], types: tuple[type, ...], what: str) -> list[Any]:
    """``gathered`` (one tuple per rank), each checked to hold values of ``types``.

    Raises:
        WireError: a rank sent something else (naming it): every rank received the
            same, so every rank raises it alike.
    """
    for rank, sent in enumerate(gathered):
        if not (type(sent) is tuple and len(sent) == len(types)
                and all(type(v) is t for v, t in zip(sent, types, strict=True))):
            raise WireError(f"agreeing on CUDA IPC: rank {rank} sent a malformed {what} "
                            f"{sent!r:.120}", op="ipc", peer=rank, agreed=True)
    return gathered


def _probe_nodes(comm: Communicator, nodes: list[str], viable: set[str],
                 failed: dict[str, list[tuple[int, str]]], device: int | None,
                 timeout: float | None) -> None:
    """Collective: the lowest rank of each node in ``viable`` probes for its node."""
    prober = nodes.index(nodes[comm.rank]) == comm.rank and nodes[comm.rank] in viable
    reason = None
    if prober:
        usable, why = probe_cuda_ipc(device)
        reason = "" if usable else why
    for rank, why in enumerate(comm.allgather_object(reason, timeout=timeout)):
        if why:
            failed.setdefault(nodes[rank], []).append((rank, why))


def _trial_nodes(comm: Communicator, nodes: list[str], exporters: list[int],
                 failed: dict[str, list[tuple[int, str]]], device: int | None,
                 timeout: float | None) -> None:
    """Collective: on every node still viable, each exporter's trial allocation is
    opened and closed by the node's other ranks."""
    here = nodes[comm.rank]
    active = here not in failed and any(nodes[r] == here for r in exporters)
    reason, uuid, handle, ptr = "", b"", b"", 0
    if active and comm.rank in exporters:
        reason, uuid, handle, ptr = _export(device)
    try:
        trials = _checked(comm.allgather_object((reason, uuid, handle), timeout=timeout),
                          (str, bytes, bytes), "trial export")
        for rank, (why, _, _) in enumerate(trials):
            if why:
                failed.setdefault(nodes[rank], []).append((rank, why))
        mine = ""
        if active and here not in failed:
            for rank in exporters:
                if rank != comm.rank and nodes[rank] == here:
                    _, peer_uuid, peer_handle = trials[rank]
                    mine = _try_open(device, peer_uuid, peer_handle) or mine
        opened = comm.allgather_object(mine, timeout=timeout)
        for rank, why in enumerate(opened):
            if why:
                failed.setdefault(nodes[rank], []).append((rank, why))
    finally:
        if ptr:
            # Every rank closed the trial mapping before the last all-gather returned.
            _free_quietly(device, ptr)


def _free_quietly(device: int | None, ptr: int) -> None:
    try:
        drv.mem_free(resolve_device(device), ptr)
    except IpcError as exc:
        log.warning("freeing the CUDA IPC trial allocation failed: %s", exc)
