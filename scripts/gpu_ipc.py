"""CUDA IPC pools between real processes, timed against open+close per message.

Run by ``scripts/gpu_check.sh`` on a GPU machine (needs torch with CUDA and
cuda-python). A producer process that is no rank of anything hands its pool's
descriptor to consumer processes over a pipe; each consumer maps the pool once and
takes its features three ways:

* ``fetch``: copy into its own memory, ordered on its stream, then the ack;
* ``view``: zero-copy inside ``with registry.view(ref)``;
* the per-message baseline: ``cudaIpcOpenMemHandle`` + copy + ``cudaIpcCloseMemHandle``
  for every feature (what an engine without a handle cache does).

Host syncs: before timing ``put``, ``fetch`` and ``view`` the stream in use is given
about a second of GPU sleep; if any of them waited on the stream, the host loop would
take that second and the stream would be idle afterwards. The driver queues only so
much work behind a busy stream (about a thousand operations) before the host blocks
whatever the call, so each timed batch stays under that: the producer puts in batches
of ``PUT_BATCH`` features (a copy and a ready word each), draining the stream between
batches, and each consumer takes at most a few hundred operations per sleep. The
script prints one table row per consumer and exits non-zero if any check fails.

    python scripts/gpu_ipc.py [--features 100]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import sys
import time
from typing import Any

NBYTES = 64 << 10
SLEEP_CYCLES = 2_000_000_000  # about a second at GPU clocks
PUT_BATCH = 128  # 256 queued operations per batch, well under the driver's queue


def _value(i: int) -> float:
    return float(i % 4096)


def producer(conn: Any, device: int, consumers: int, per: int) -> None:
    import torch

    from distcache.ipc import CudaPool

    torch.cuda.set_device(device)
    pool = CudaPool(96 << 20, device, name=f"gpucheck-{os.getpid()}")
    pool.bind(owner=None, consumers=list(range(consumers)))
    conn.send_bytes(pool.descriptor().pack())
    total = consumers * 3 * per
    sources = [torch.full((NBYTES // 4,), _value(i), device=device) for i in range(total)]
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    refs = []
    elapsed, put_async = 0.0, True
    for first in range(0, total, PUT_BATCH):
        torch.cuda._sleep(SLEEP_CYCLES)
        started = time.perf_counter()
        for i in range(first, min(first + PUT_BATCH, total)):
            ref = pool.put(sources[i], [i % consumers])
            assert ref is not None, "pool full"
            refs.append((i, ref.pack()))
        elapsed += time.perf_counter() - started
        put_async = put_async and not stream.query()
        stream.synchronize()  # drained, so the next batch queues behind its own sleep
    put_us = elapsed / total * 1e6
    conn.send({"refs": refs, "put_us": put_us, "put_async": put_async})
    assert conn.recv() == "done"
    torch.cuda.synchronize()
    freed = pool.reclaim()
    pool.close()
    conn.send({"reclaimed": freed, "total": total})


def consumer(conn: Any, index: int, device: int) -> None:
    import torch
    from cuda.bindings import runtime as rt

    from distcache.ipc import FeatureRef, PoolDescriptor, PoolRegistry
    from distcache.ipc._devmap import unpack_handle
    from distcache.ipc._driver import DeviceArray

    torch.cuda.set_device(device)
    registry = PoolRegistry(index, device=device)
    packed = conn.recv_bytes()
    registry.add(packed)
    mine = [(i, FeatureRef.unpack(b)) for i, b in conn.recv()]
    third = len(mine) // 3
    fetch_part, view_part, base_part = mine[:third], mine[third : 2 * third], mine[2 * third :]
    stream = torch.cuda.current_stream()

    torch.cuda._sleep(SLEEP_CYCLES)
    started = time.perf_counter()
    fetched = [registry.fetch(ref) for _, ref in fetch_part]
    fetch_us = (time.perf_counter() - started) / len(fetch_part) * 1e6
    fetch_async = not stream.query()

    torch.cuda._sleep(SLEEP_CYCLES)
    started = time.perf_counter()
    viewed = []
    for _, ref in view_part:
        with registry.view(ref) as t:
            viewed.append(t[:1].clone())  # queued on the same stream, before the ack
    view_us = (time.perf_counter() - started) / len(view_part) * 1e6
    view_async = not stream.query()
    torch.cuda.synchronize()

    firsts = torch.stack([t[:1] for t in fetched] + viewed).view(-1).cpu().tolist()
    expected = [_value(i) for i, _ in fetch_part + view_part]
    assert firsts == expected, "fetched or viewed bytes differ from what was put"
    assert all(bool((f == f[0]).all()) for f in fetched[:8]), "a fetched feature is torn"
    opens = dict(registry.opens)
    del t
    # Unmapped now (the last view died with ``t``), so each open below really maps
    # the pool again; the producer frees nothing before the parent says "done".
    registry.close()

    # The per-message baseline: the runtime's open and close around every copy.
    descriptor = PoolDescriptor.unpack(packed)
    ipc, _, nbytes, _, _ = unpack_handle(descriptor.handle)
    handle = rt.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), ipc, len(ipc))
    baseline = []
    started = time.perf_counter()
    for _, ref in base_part:
        err, ptr = rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
        assert int(err) == 0, f"cudaIpcOpenMemHandle: {err}"
        whole = torch.as_tensor(DeviceArray(int(ptr), nbytes, None), device=f"cuda:{device}")
        start = ref.offset - descriptor.data_start
        baseline.append(whole[start : start + ref.nbytes].view(torch.float32)[:1].clone())
        del whole
        torch.cuda.synchronize()  # the copy must land before the mapping goes
        (err,) = rt.cudaIpcCloseMemHandle(ptr)
        assert int(err) == 0, f"cudaIpcCloseMemHandle: {err}"
    torch.cuda.synchronize()
    per_message_us = (time.perf_counter() - started) / len(base_part) * 1e6
    got = torch.cat(baseline).cpu().tolist()
    assert got == [_value(i) for i, _ in base_part], "baseline read other bytes"
    conn.send({
        "index": index, "device": device, "fetch_us": fetch_us, "view_us": view_us,
        "per_message_us": per_message_us, "fetch_async": fetch_async,
        "view_async": view_async, "opens": opens,
    })  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=100, help="per consumer and per way")
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("gpu_ipc: no CUDA device")
        return 2
    # Same-device consumers always; a cross-device consumer only with two GPUs.
    devices = [0, 0] + ([1] if gpus >= 2 else [])
    if gpus < 2:
        print("gpu_ipc: SKIP cross-device IPC: one GPU visible")
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    procs = [ctx.Process(target=producer, args=(p_child, 0, len(devices), args.features))]
    c_conns = []
    for index, device in enumerate(devices):
        mine, theirs = ctx.Pipe()
        c_conns.append(mine)
        procs.append(ctx.Process(target=consumer, args=(theirs, index, device)))
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    try:
        descriptor = _recv(p_conn, deadline, bytes_=True)
        for conn in c_conns:
            conn.send_bytes(descriptor)  # over a pipe: the producer is no rank of theirs
        made = _recv(p_conn, deadline)
        for index, conn in enumerate(c_conns):
            conn.send([(i, b) for i, b in made["refs"] if i % len(devices) == index])
        rows = [_recv(conn, deadline) for conn in c_conns]
        p_conn.send("done")
        closing = _recv(p_conn, deadline)
    finally:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    print(f"put: {made['put_us']:.1f} us/feature, host-sync-free: {made['put_async']}")
    print(
        "| consumer | device | open+close per message us/feature | map-once fetch us/feature "
        "| map-once view us/feature | opens | no host sync (fetch/view) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['index']} | cuda:{r['device']} | {r['per_message_us']:.1f} | "
            f"{r['fetch_us']:.1f} | {r['view_us']:.1f} | {sum(r['opens'].values())} | "
            f"{r['fetch_async']}/{r['view_async']} |"
        )
    ok = (
        not failed
        and made["put_async"]
        and all(r["fetch_async"] and r["view_async"] for r in rows)
        and all(list(r["opens"].values()) == [1] for r in rows)
        and closing["reclaimed"] == closing["total"]
    )
    print("gpu_ipc:", "PASS" if ok else f"FAIL (exit codes {failed}, reclaimed {closing})")
    return 0 if ok else 1


def _recv(conn: Any, deadline: float, bytes_: bool = False) -> Any:
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError("a gpu_ipc process went silent")
    return conn.recv_bytes() if bytes_ else conn.recv()


if __name__ == "__main__":
    sys.exit(main())
