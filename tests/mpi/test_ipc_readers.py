"""Declared readers and producers outside the group, under ``mpirun -n N`` (MPI or
torch communicator), on host shared memory.

* One producer rank, N-1 consumer ranks, a 1 MiB pool, 3,000 features of 8-64 KiB, each
  declared for exactly one reader that takes it with ``fetch``: every feature arrives
  intact, no put is dropped (a full pool is retried after a reclaim, within a
  deadline), and each consumer maps the pool once.
* A producer process that is no rank of the communicator hands its descriptor over a
  pipe; every rank maps it once and fetches its share of 1,000 features intact.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distcache.comm import Communicator
from distcache.errors import IpcError
from distcache.ipc import FeatureRef, PoolRegistry, ShmPool
from tests.support import ipc_exchange
from tests.support.ipc_exchange import FLUSH, feature, parse_outside_item, shm_names
from tests.support.process import kill_group

pytestmark = pytest.mark.mpi(min_size=2)

PRODUCER = 0
DECLARED = 3000
OUTSIDE = 1000
DEADLINE_S = 300.0
TIMEOUT = 120.0
_ITEM = struct.Struct("<IH")  # feature index, packed ref length


def _prefix(shared_tmp: Path) -> str:
    return "rd" + shared_tmp.name.replace("distcache-mpi-", "")


def _encode(items: list[tuple[int, bytes]], done: bool) -> bytes:
    body = b"".join(_ITEM.pack(i, len(p)) + p for i, p in items)
    return struct.pack("<?I", done, len(items)) + body


def _decode(blob: bytes) -> tuple[list[tuple[int, FeatureRef]], bool]:
    done, count = struct.unpack_from("<?I", blob)
    pos, items = struct.calcsize("<?I"), []
    for _ in range(count):
        i, length = _ITEM.unpack_from(blob, pos)
        pos += _ITEM.size
        items.append((i, FeatureRef.unpack(blob[pos : pos + length])))
        pos += length
    assert pos == len(blob)
    return items, done


def _check(got: torch.Tensor, i: int) -> None:
    expected = feature(i)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (i, got.shape)
    # Bytes, not values: random bytes hold NaNs, and NaN != NaN.
    same = torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))
    assert same, f"feature {i} arrived corrupted"


def test_each_feature_declared_for_one_reader_arrives_intact_and_no_put_is_dropped(
    comm: Communicator, shared_tmp: Path
) -> None:
    name = f"{_prefix(shared_tmp)}-declared"
    pool = ShmPool(1 << 20, name=name) if comm.rank == PRODUCER else None
    registry = PoolRegistry.exchange(comm, [pool] if pool else [], timeout=TIMEOUT)
    readers = [r for r in range(comm.size) if r != PRODUCER]
    deadline = time.monotonic() + DEADLINE_S
    sent = waits = fetched = refused = 0
    try:
        if pool is not None:
            assert pool.consumers == tuple(readers)
        while True:
            batch = None
            if pool is not None:
                items: list[tuple[int, bytes]] = []
                while sent < DECLARED:
                    ref = pool.put(feature(sent), [readers[sent % len(readers)]])
                    if ref is None:
                        if items:
                            break  # hand these out; their acks make room
                        waits += 1  # everything sent is being read: wait for acks
                        assert time.monotonic() < deadline, "the pool stayed full"
                        if not pool.reclaim():
                            time.sleep(0.0005)
                        continue
                    items.append((sent, ref.pack()))
                    sent += 1
                batch = _encode(items, sent == DECLARED)
            got, done = _decode(comm.broadcast_bytes(batch, PRODUCER, timeout=TIMEOUT))
            for i, ref in got:
                reader = readers[i % len(readers)]
                if comm.rank == reader:
                    _check(registry.fetch(ref), i)
                    fetched += 1
                elif comm.rank != PRODUCER and i % 97 == 0:
                    # Not declared for this rank: refused (or already released).
                    with pytest.raises(IpcError, match=r"not declared|released"):
                        registry.fetch(ref)
                    refused += 1
            if done:
                break
        summary = {
            "rank": comm.rank,
            "fetched": fetched,
            "opens": registry.opens,
            "sent": sent,
            "waits": waits,
            "refused": refused,
        }
        everyone = comm.allgather_object(summary, timeout=TIMEOUT)
        assert everyone[PRODUCER]["sent"] == DECLARED  # no drops: every put succeeded
        for r in readers:
            share = sum(1 for i in range(DECLARED) if readers[i % len(readers)] == r)
            assert everyone[r]["fetched"] == share
            assert everyone[r]["opens"] == {name: 1}
        assert everyone[PRODUCER]["opens"] == {}
        if pool is not None:
            # Every fetch acked after its copy: the whole pool comes back.
            pool.reclaim()
            assert pool.in_flight == 0
            assert pool.free_bytes == pool.capacity
            # A 1 MiB pool cannot hold 3,000 features of 8-64 KiB at once: it was
            # full many times, and every put was retried until it got a lease.
            assert pool.full_count > 0
    finally:
        registry.close()
        comm.barrier(timeout=TIMEOUT)
        if pool is not None:
            pool.close()
    comm.barrier(timeout=TIMEOUT)
    assert shm_names(_prefix(shared_tmp)) == set()


class _Pipe:
    """Frames from a producer's stdout, each read within the deadline."""

    def __init__(self, proc: subprocess.Popen[bytes], deadline: float) -> None:
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()
        self._deadline = deadline

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            left = self._deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(left, 0))
            assert ready, "the outside producer went silent"
            chunk = os.read(self._fd, n - len(out))
            if not chunk:
                break
            out += chunk
        return out


def _spawn_outside(consumers: int, prefix: str) -> subprocess.Popen[bytes]:
    # Not an MPI process: none of the launcher's variables, so it joins no job.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    script = Path(ipc_exchange.__file__)
    return subprocess.Popen(
        [sys.executable, str(script), "outside", str(consumers), prefix, str(OUTSIDE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        start_new_session=True,
        cwd=script.parents[2],
    )


def test_a_producer_outside_the_group_hands_its_descriptor_over_a_pipe(
    comm: Communicator, shared_tmp: Path
) -> None:
    prefix = _prefix(shared_tmp)
    proc = _spawn_outside(comm.size, prefix) if comm.rank == 0 else None
    pipe = _Pipe(proc, time.monotonic() + DEADLINE_S) if proc else None
    registry = PoolRegistry(comm.rank)
    fetched = 0
    try:
        packed = ipc_exchange.read_frame(pipe) if pipe else None
        descriptor = comm.broadcast_bytes(packed, 0, timeout=TIMEOUT)
        registry.add(descriptor)  # bytes, as they came over the pipe
        registry.add(descriptor)  # again: still one mapping
        while True:
            blob = None
            if pipe is not None:
                items, done = [], False
                while len(items) < 32:
                    frame = ipc_exchange.read_frame(pipe)
                    if frame == b"":
                        done = True
                        break
                    if frame == FLUSH:
                        break
                    index, _, ref = parse_outside_item(frame)
                    items.append((index, ref.pack()))
                blob = _encode(items, done)
            got, done = _decode(comm.broadcast_bytes(blob, 0, timeout=TIMEOUT))
            for i, ref in got:
                if i % comm.size == comm.rank:
                    _check(registry.fetch(ref), i)
                    fetched += 1
            if done:
                break
        counts = comm.allgather_object((fetched, registry.opens), timeout=TIMEOUT)
        assert sum(n for n, _ in counts) == OUTSIDE
        assert all(opens == {f"{prefix}-outside": 1} for _, opens in counts)
        registry.close()
        comm.barrier(timeout=TIMEOUT)
        if proc is not None and pipe is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            summary = json.loads(ipc_exchange.read_frame(pipe))
            assert summary["sent"] == OUTSIDE and summary["in_flight"] == 0
            assert summary["linked"] is False  # unlinked once every consumer mapped it
            assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        registry.close()
        if proc is not None:
            kill_group(proc)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
    comm.barrier(timeout=TIMEOUT)
    assert shm_names(prefix) == set()
