"""One producer, N-1 consumers, 10,000 features through IPC pools across real processes.

Shared by the ``mpirun`` suite (``tests/mpi/test_ipc.py``, on the MPI and the torch
communicator) and the multi-process unit test (``tests/unit/test_ipc_multiprocess.py``,
which launches this file under ``mpirun -n 4``). Rank 0 produces; the last rank is
the slow consumer; the ranks in between are fast consumers.

What one run checks, on top of the asserts each rank makes as it goes:

* every byte arrives intact: a crc32 per feature and a sha256 over the whole stream,
  computed by the producer from its source bytes and by each consumer from the view
  it resolved;
* each consumer maps each pool once (``opens == {pool: 1}``) however many features
  pass; the producer never maps its own pools;
* a lease is recycled only when every consumer acked it: the slow consumer holds the
  whole "tight" pool through the bulk exchange (the producer gets no lease, at once),
  and lags one batch behind on the bulk pool (the producer reclaims exactly the batch
  before); the fast consumers never wait for it;
* out-of-bounds, forged and stale refs raise ``IpcError``/``StaleHandleError``.

Run as a script under ``mpirun`` (the communicator is ``COMM_WORLD``)::

    mpirun -n 4 python tests/support/ipc_exchange.py exchange shm|cuda PREFIX OUTDIR
    mpirun -n 4 python tests/support/ipc_exchange.py kill VICTIM_RANK PREFIX OUTDIR

and, without ``mpirun``, as a producer that is no rank of its consumers' group::

    python tests/support/ipc_exchange.py outside CONSUMERS PREFIX COUNT

``outside`` binds a 1 MiB pool to consumer ranks ``0..CONSUMERS-1`` with no owner
rank and writes length-prefixed frames to stdout: the packed descriptor, then one
frame per feature (its index, its reader, its packed ref), a ``FLUSH`` frame each time
it has to wait for acknowledgements, and an empty frame at the end. It never drops a
feature: a full pool is retried after a reclaim until the deadline. Once stdin
closes it writes a JSON summary frame and exits.

``kill`` makes rank VICTIM_RANK SIGKILL itself mid-burst (rank 0 with leases in flight
in its own pool, any other rank while it holds resolved, unacknowledged views), so the
caller can check that nothing is left in ``/dev/shm``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import signal
import struct
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distcache.comm import Communicator
from distcache.errors import IpcError, StaleHandleError
from distcache.ipc import CudaPool, FeatureRef, PoolRegistry, ShmPool
from distcache.ipc._producer import ProducerPool
from distcache.ipc._shm import SHM_DIR

__all__ = [
    "FEATURES",
    "FLUSH",
    "feature",
    "parse_outside_item",
    "put_waiting",
    "read_frame",
    "run_exchange",
    "run_kill",
    "serve_outside",
    "shm_names",
    "write_frame",
]

PRODUCER = 0
FEATURES = 10_000
BATCH = 500
#: One feature in LARGE_EVERY is 64-256 KiB; the rest are 64 B-4 KiB.
LARGE_EVERY = 100
BULK_CAPACITY = 16 << 20  # three batches of the worst case fit: no lazy reclaim
BULK_SLOTS = 2048
TIGHT_SLOTS = 8
TIGHT_FEATURE = 128  # aligned to 256: eight of them fill the tight pool's bytes too
TIGHT_CAPACITY = TIGHT_SLOTS * 256
TIMEOUT = 120.0
DTYPES = (
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
_ITEM = struct.Struct("<IH")  # crc32, packed ref length


def shm_names(prefix: str = "") -> set[str]:
    """Names under /dev/shm that a distcache pool made (optionally of one prefix)."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"distcache.{prefix}")}


def _shape(i: int, numel: int) -> tuple[int, ...]:
    if i % 3 == 1 and numel % 4 == 0:
        return (4, numel // 4)
    if i % 3 == 2 and numel % 8 == 0:
        return (2, 4, numel // 8)
    return (numel,)


def _make(i: int, rng: random.Random, device: torch.device) -> torch.Tensor:
    """Feature ``i``: a dtype, a shape and random bytes, 64 B to 256 KiB."""
    dtype = DTYPES[i % len(DTYPES)]
    if i == 0:
        nbytes = 256 << 10
    elif i == 1:
        nbytes = 64
    elif i % LARGE_EVERY == 0:
        nbytes = rng.randrange(64 << 10, (256 << 10) + 1)
    else:
        nbytes = rng.randrange(64, 4097)
    numel = nbytes // dtype.itemsize
    raw = bytearray(rng.randbytes(numel * dtype.itemsize))
    tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(_shape(i, numel))
    return tensor.to(device)


def _bytes(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a host buffer (a copy only for device tensors)."""
    return tensor.reshape(-1).view(torch.uint8).cpu().numpy()


def _encode(items: list[tuple[bytes, int]]) -> bytes:
    return struct.pack("<I", len(items)) + b"".join(
        _ITEM.pack(crc, len(packed)) + packed for packed, crc in items
    )


def _decode(blob: bytes) -> list[tuple[FeatureRef, int]]:
    (count,) = struct.unpack_from("<I", blob)
    pos, out = 4, []
    for _ in range(count):
        crc, length = _ITEM.unpack_from(blob, pos)
        pos += _ITEM.size
        out.append((FeatureRef.unpack(blob[pos : pos + length]), crc))
        pos += length
    assert pos == len(blob)
    return out


def _pool(device: torch.device, capacity: int, name: str, slots: int) -> ProducerPool:
    if device.type == "cuda":
        return CudaPool(capacity, device, name=name, slots=slots)
    return ShmPool(capacity, name=name, slots=slots)


def _settle(device: torch.device) -> None:
    # CUDA acks are queued on the consumer's stream; they must land before the producer
    # is told (by the next collective) to look at them.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _resolve_checked(
    registry: PoolRegistry, ref: FeatureRef, crc: int, device: torch.device, digest: Any = None
) -> torch.Tensor:
    view = registry.resolve(ref)
    assert view.device == device, (view.device, device)
    assert str(view.dtype) == f"torch.{ref.dtype}" and tuple(view.shape) == ref.shape, ref
    data = _bytes(view)
    assert zlib.crc32(data) == crc, f"feature at slot {ref.slot} of {ref.pool_id} differs"
    if digest is not None:
        digest.update(data)
    return view


def _forged_refs_raise(
    registry: PoolRegistry, live: FeatureRef, crc: int, device: torch.device
) -> int:
    """Every forged, out-of-bounds or stale variant of ``live`` is refused; returns the
    number of variants tried. ``live`` still resolves intact afterwards."""
    # The producer sent ``live`` with its pool's descriptor: the real mapping's edges.
    entry_desc = live.descriptor
    assert entry_desc is not None
    live = live.without_descriptor()
    end = entry_desc.data_start + entry_desc.capacity

    def forge(**changes: Any) -> FeatureRef:
        return dataclasses.replace(live, **changes)

    def raw(offset: int, nbytes: int) -> FeatureRef:
        return forge(offset=offset, nbytes=nbytes, dtype="uint8", shape=(nbytes,), strides=(1,))

    refused: list[tuple[FeatureRef, type[IpcError], str]] = [
        (raw(end, 256), IpcError, "outside pool"),  # just past the end
        (raw(end - 256, 512), IpcError, "outside pool"),  # straddles the end
        (raw(1 << 40, 256), IpcError, "outside pool"),  # far past the mapping
        (raw(0, 256), IpcError, "outside pool"),  # the control words, not data
        (forge(offset=live.offset + 1), IpcError, "outside pool"),  # misaligned
        (forge(slot=entry_desc.slots), IpcError, "outside pool"),  # no such slot
        (forge(generation=live.generation + 1), IpcError, "holds generation"),  # forged gen
        (forge(epoch=live.epoch + 1), StaleHandleError, "epoch"),  # not mapped (newer)
        (forge(epoch=live.epoch - 1), StaleHandleError, "epoch"),  # an older incarnation
        (forge(pool_id="forged-pool"), IpcError, "not mapped"),
    ]
    for ref, error, words in refused:
        for call in (registry.resolve, registry.ack):
            try:
                call(ref)
            except error as exc:
                assert words in str(exc), (ref, exc)
                assert exc.pool_id == ref.pool_id, exc  # type: ignore[attr-defined]
            else:
                raise AssertionError(f"{call.__name__} accepted a forged ref {ref}")
    packed = live.pack()
    garbled = [packed[:-1], packed + b"\0", b"XYZ" + packed[3:], packed[:3] + b"\x09" + packed[4:]]
    for blob in garbled:
        try:
            FeatureRef.unpack(blob)
        except IpcError:
            pass
        else:
            raise AssertionError(f"garbled ref bytes decoded: {blob!r}")
    _resolve_checked(registry, live, crc, device)
    return len(refused) * 2 + len(garbled)


def run_exchange(
    comm: Communicator,
    device: torch.device,
    prefix: str,
    *,
    features: int = FEATURES,
    batch: int = BATCH,
) -> list[dict[str, Any]]:
    """Run the scenario (collective); returns every rank's summary, in rank order."""
    assert comm.size >= 2, "one producer and at least one consumer"
    rank, size = comm.rank, comm.size
    slow = size - 1
    role = "producer" if rank == PRODUCER else "slow" if rank == slow else "fast"
    bulk_id, tight_id = f"{prefix}-bulk", f"{prefix}-tight"
    pools: list[ProducerPool] = []
    if rank == PRODUCER:
        pools = [
            _pool(device, BULK_CAPACITY, bulk_id, BULK_SLOTS),
            _pool(device, TIGHT_CAPACITY, tight_id, TIGHT_SLOTS),
        ]
        for pool in pools:
            if isinstance(pool, ShmPool):
                assert os.path.exists(pool.path), pool.path
    registry = PoolRegistry.exchange(comm, pools, timeout=TIMEOUT)
    summary: dict[str, Any] = {"rank": rank, "role": role}
    try:
        assert registry.backend == device.type.replace("cpu", "shm"), registry.backend
        for pool in pools:
            # The owner unlinked its names at the exchange barrier: a crash leaks nothing.
            assert not isinstance(pool, ShmPool) or not os.path.exists(pool.path)
            assert pool.consumers == tuple(range(1, size)), pool.consumers
        expected_opens = {} if rank == PRODUCER else {bulk_id: 1, tight_id: 1}
        assert registry.opens == expected_opens, registry.opens
        if rank == PRODUCER:
            bulk, tight = pools
            summary.update(_produce(comm, device, registry, bulk, tight, features, batch))
        else:
            summary.update(_consume(comm, device, registry, role, features))
        assert registry.opens == expected_opens, registry.opens
        summary["opens"] = dict(registry.opens)
        everyone = comm.allgather_object(summary, timeout=TIMEOUT)
    except BaseException:
        # No collective on the way out of a failure: the peers would only wait for it.
        registry.close()
        for pool in pools:
            pool.close()
        raise
    registry.close()
    comm.barrier(timeout=TIMEOUT)  # consumers unmap before the producer frees
    for pool in pools:
        pool.close()
    comm.barrier(timeout=TIMEOUT)
    assert shm_names(prefix) == set()
    digest = everyone[PRODUCER]["sha256"]
    for other in everyone[1:]:
        assert other["verified"] == features and other["sha256"] == digest, other
        assert other["opens"] == {bulk_id: 1, tight_id: 1}, other
    assert everyone[PRODUCER]["opens"] == {}
    return everyone


def _produce(
    comm: Communicator,
    device: torch.device,
    registry: PoolRegistry,
    bulk: ProducerPool,
    tight: ProducerPool,
    features: int,
    batch: int,
) -> dict[str, Any]:
    rng = random.Random(20240611)
    # -- the tight pool: filled, held by the slow consumer ---------------------------
    try:
        tight.put(torch.zeros(TIGHT_CAPACITY + 1, dtype=torch.uint8, device=device))
    except IpcError as exc:
        assert f"{TIGHT_CAPACITY + 1} bytes" in str(exc), exc
    else:
        raise AssertionError("a feature larger than the tight pool was not refused")
    held = []
    for i in range(TIGHT_SLOTS):
        t = torch.full((TIGHT_FEATURE,), i + 1, dtype=torch.uint8, device=device)
        ref = tight.put(t)
        assert ref is not None, f"tight pool refused feature {i}"
        held.append((ref, zlib.crc32(_bytes(t))))
    assert tight.free_bytes == 0 and tight.in_flight == TIGHT_SLOTS
    comm.broadcast_bytes(_encode([(r.pack(), c) for r, c in held]), PRODUCER, timeout=TIMEOUT)
    comm.allgather_object(None, timeout=TIMEOUT)  # fast consumers acked, the slow one holds
    no_lease = 0
    assert tight.reclaim() == 0 and tight.in_flight == TIGHT_SLOTS
    assert tight.put(torch.ones(TIGHT_FEATURE, dtype=torch.uint8, device=device)) is None
    no_lease += 1
    # -- the bulk exchange, while the slow consumer still holds the tight pool -------
    digest = hashlib.sha256()
    previous: set[int] = set()
    sent = reclaimed = 0
    for start in range(0, features, batch):
        items, slots = [], set()
        for i in range(start, min(start + batch, features)):
            t = _make(i, rng, device)
            data = _bytes(t)
            digest.update(data)
            ref = bulk.put(t)
            assert ref is not None, f"bulk pool refused feature {i}"
            slots.add(ref.slot)
            items.append((ref.pack(), zlib.crc32(data)))
        # Slots the slow consumer still holds (the previous batch) are never reissued.
        assert not slots & previous, sorted(slots & previous)
        comm.broadcast_bytes(_encode(items), PRODUCER, timeout=TIMEOUT)
        sent += len(items)
        status = comm.allgather_object(None, timeout=TIMEOUT)
        # Fast consumers acked this batch; the slow one acked only the previous one.
        for r, (resolved, acked) in enumerate(status[1:], start=1):
            assert resolved == sent, (r, resolved, sent)
            assert acked == (sent - len(items) if r == comm.size - 1 else sent), (r, acked)
        freed = bulk.reclaim()
        assert freed == len(previous), (freed, len(previous))
        assert bulk.in_flight == len(items), bulk.in_flight
        reclaimed += freed
        previous = slots
        if start == 0:
            assert tight.put(torch.ones(1, dtype=torch.uint8, device=device)) is None
            no_lease += 1
    # -- the slow consumer acks half of the tight pool: exactly that half is reused --
    assert tight.reclaim() == 0
    assert tight.put(torch.ones(1, dtype=torch.uint8, device=device)) is None
    no_lease += 1
    comm.allgather_object(None, timeout=TIMEOUT)  # the checks above saw the slow one hold
    comm.allgather_object(None, timeout=TIMEOUT)  # slow consumer acked the last bulk batch
    assert bulk.reclaim() == len(previous) and bulk.in_flight == 0
    assert bulk.free_bytes == bulk.capacity
    reclaimed += len(previous)
    comm.allgather_object(None, timeout=TIMEOUT)  # ... and the first half of the tight pool
    half = TIGHT_SLOTS // 2
    assert tight.reclaim() == half and tight.in_flight == TIGHT_SLOTS - half
    fresh = []
    for i in range(half):
        t = torch.full((TIGHT_FEATURE,), 100 + i, dtype=torch.uint8, device=device)
        ref = tight.put(t, with_descriptor=i == 0)
        assert ref is not None, "a slot every consumer acked was not reused"
        fresh.append((ref, zlib.crc32(_bytes(t))))
    assert tight.put(torch.ones(1, dtype=torch.uint8, device=device)) is None
    no_lease += 1
    old = {ref.slot: ref for ref, _ in held[:half]}
    assert {r.slot for r, _ in fresh} == set(old), "reused slots are not the acked ones"
    assert {r.offset for r, _ in fresh} == {r.offset for r in old.values()}
    assert all(r.generation == old[r.slot].generation + 1 for r, _ in fresh)
    comm.broadcast_bytes(_encode([(r.pack(), c) for r, c in fresh]), PRODUCER, timeout=TIMEOUT)
    comm.allgather_object(None, timeout=TIMEOUT)  # everyone acked everything
    assert tight.reclaim() == TIGHT_SLOTS and tight.in_flight == 0
    assert tight.free_bytes == tight.capacity
    assert tight.full_count == no_lease  # the over-capacity put raised, it was not "full"
    # A producer never maps its own pool, not even to resolve a ref of its own.
    try:
        registry.resolve(FeatureRef.unpack(items[0][0]))
    except IpcError as exc:
        assert "own pool" in str(exc), exc
    else:
        raise AssertionError("the producer resolved a ref of its own pool")
    return {
        "sha256": digest.hexdigest(),
        "sent": sent,
        "reclaimed": reclaimed,
        "no_lease": no_lease,
        "verified": sent,
    }


def _consume(
    comm: Communicator, device: torch.device, registry: PoolRegistry, role: str, features: int
) -> dict[str, Any]:
    slow = role == "slow"
    tight = _decode(comm.broadcast_bytes(None, PRODUCER, timeout=TIMEOUT))
    views = [_resolve_checked(registry, ref, crc, device) for ref, crc in tight]
    if not slow:
        for ref, _ in tight:
            registry.ack(ref)
    del views
    _settle(device)
    comm.allgather_object(None, timeout=TIMEOUT)
    digest = hashlib.sha256()
    resolved = acked = 0
    lagging: list[tuple[FeatureRef, int, torch.Tensor]] = []
    while resolved < features:
        batch = _decode(comm.broadcast_bytes(None, PRODUCER, timeout=TIMEOUT))
        current = []
        for ref, crc in batch:
            view = _resolve_checked(registry, ref, crc, device, digest)
            resolved += 1
            if slow:
                current.append((ref, crc, view))
            else:
                registry.ack(ref)
                acked += 1
        for ref, crc, view in lagging:
            # Held across a whole batch of the producer's writes: still intact.
            assert zlib.crc32(_bytes(view)) == crc, f"held feature at slot {ref.slot} changed"
            registry.ack(ref)
            acked += 1
        lagging = current
        _settle(device)
        comm.allgather_object((resolved, acked), timeout=TIMEOUT)
    comm.allgather_object(None, timeout=TIMEOUT)
    for ref, crc, view in lagging:
        assert zlib.crc32(_bytes(view)) == crc
        registry.ack(ref)
        acked += 1
    del lagging
    # The slow consumer's tight features survived the whole bulk exchange untouched.
    if slow:
        for ref, crc in tight:
            _resolve_checked(registry, ref, crc, device)
    _settle(device)
    comm.allgather_object(None, timeout=TIMEOUT)
    half = TIGHT_SLOTS // 2
    if slow:
        for ref, _ in tight[:half]:
            registry.ack(ref)
    _settle(device)
    comm.allgather_object(None, timeout=TIMEOUT)
    fresh = _decode(comm.broadcast_bytes(None, PRODUCER, timeout=TIMEOUT))
    for ref, crc in fresh:
        _resolve_checked(registry, ref, crc, device)
    # The acked half of the tight pool was reissued: its old refs are now stale.
    for ref, _ in tight[:half]:
        try:
            registry.resolve(ref)
        except IpcError as exc:
            assert "holds generation" in str(exc), exc
        else:
            raise AssertionError(f"a recycled slot resolved for its old ref {ref}")
    forged = _forged_refs_raise(registry, fresh[0][0], fresh[0][1], device)
    for ref, _ in fresh:
        registry.ack(ref)
    if slow:
        for ref, _ in tight[half:]:
            registry.ack(ref)
    _settle(device)
    comm.allgather_object(None, timeout=TIMEOUT)
    return {
        "sha256": digest.hexdigest(),
        "verified": resolved,
        "acked": acked,
        "forged_refused": forged,
    }


# -- the kill scenario (script only: a rank kills itself) -----------------------------


def run_kill(comm: Communicator, victim: int, prefix: str, outdir: Path) -> None:
    """Every rank owns a pool and feeds every other rank until ``victim`` SIGKILLs
    itself mid-burst; the launcher then tears the job down."""
    rank = comm.rank
    pool = ShmPool(1 << 20, name=f"{prefix}-k{rank}", slots=256)
    linked_before = os.path.exists(pool.path)
    registry = PoolRegistry.exchange(comm, [pool], timeout=TIMEOUT)
    (outdir / f"exchanged.{rank}").write_text(
        json.dumps(
            {
                "linked_before": linked_before,
                "linked_after": os.path.exists(pool.path),
                "opens": registry.opens,
            }
        )
    )
    rng = random.Random(rank)
    held: list[torch.Tensor] = []
    for burst in range(1000):
        refs = []
        for i in range(32):
            ref = pool.put(_make(2 + i, rng, torch.device("cpu")))
            if ref is not None:
                refs.append(ref.pack())
            if rank == victim == PRODUCER and burst == 3 and i == 16:
                _die(outdir, rank, pool.in_flight)
        everyone = comm.allgather_object(refs, timeout=TIMEOUT)
        for src, packed in enumerate(everyone):
            for n, blob in enumerate(packed if src != rank else []):
                ref = FeatureRef.unpack(blob)
                held.append(registry.resolve(ref))
                if rank == victim and burst == 3 and n == 16:
                    _die(outdir, rank, len(held))
                if n % 2 == 0:
                    registry.ack(ref)
        held = held[-64:]
    raise AssertionError("the victim never died")


FLUSH = b"flush"
_FRAME = struct.Struct("<I")
_OUTSIDE_ITEM = struct.Struct("<II")  # feature index, reader rank


def write_frame(stream: Any, payload: bytes) -> None:
    stream.write(_FRAME.pack(len(payload)) + payload)


def read_frame(stream: Any) -> bytes:
    head = stream.read(_FRAME.size)
    if len(head) != _FRAME.size:
        raise EOFError("the producer closed its pipe")
    (length,) = _FRAME.unpack(head)
    payload = stream.read(length)
    if len(payload) != length:
        raise EOFError("the producer closed its pipe mid-frame")
    return bytes(payload)


def feature(i: int) -> torch.Tensor:
    """Feature ``i`` of the declared-reader runs: 8-64 KiB of seeded bytes, a dtype."""
    rng = random.Random(i)
    dtype = DTYPES[i % len(DTYPES)]
    numel = rng.randrange(8 << 10, (64 << 10) + 1) // dtype.itemsize
    raw = bytearray(rng.randbytes(numel * dtype.itemsize))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(_shape(i, numel))


def put_waiting(
    pool: ProducerPool,
    tensor: torch.Tensor,
    readers: list[int],
    deadline: float,
    on_full: Callable[[], None] = lambda: None,
) -> tuple[FeatureRef, int]:
    """``pool.put``, retried after a reclaim while the pool is full: (ref, waits).
    ``on_full`` runs once, before the first wait (to hand out what was sent).

    Raises:
        AssertionError: the pool stayed full until ``deadline`` (a drop).
    """
    waits = 0
    while True:
        ref = pool.put(tensor, readers)
        if ref is not None:
            return ref, waits
        if waits == 0:
            on_full()
        waits += 1
        assert time.monotonic() < deadline, f"the pool stayed full: {pool.in_flight} leases held"
        if not pool.reclaim():
            time.sleep(0.0005)


def serve_outside(consumers: int, prefix: str, count: int, out: Any, inp: Any) -> None:
    """The ``outside`` scenario (see the module doc)."""
    deadline = time.monotonic() + TIMEOUT
    with ShmPool(1 << 20, name=f"{prefix}-outside") as pool:
        pool.bind(owner=None, consumers=list(range(consumers)))
        write_frame(out, pool.descriptor().pack())
        out.flush()
        waits = 0

        def flush() -> None:
            write_frame(out, FLUSH)  # let the consumers take what was sent
            out.flush()

        for i in range(count):
            reader = i % consumers
            ref, waited = put_waiting(pool, feature(i), [reader], deadline, flush)
            waits += waited
            write_frame(out, _OUTSIDE_ITEM.pack(i, reader) + ref.pack())
        write_frame(out, b"")
        out.flush()
        inp.read()  # the consumers are done when they close our stdin
        pool.reclaim()
        summary = {
            "sent": count,
            "waits": waits,
            "in_flight": pool.in_flight,
            "linked": pool.linked,
        }
        write_frame(out, json.dumps(summary).encode())
        out.flush()


def parse_outside_item(payload: bytes) -> tuple[int, int, FeatureRef]:
    index, reader = _OUTSIDE_ITEM.unpack_from(payload)
    return index, reader, FeatureRef.unpack(payload[_OUTSIDE_ITEM.size :])


def _die(outdir: Path, rank: int, holding: int) -> None:
    (outdir / f"killed.{rank}").write_text(str(holding))
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    from distcache.comm import from_mpi

    scenario, arg, prefix, outdir = argv
    if scenario == "outside":
        serve_outside(int(arg), prefix, int(outdir), sys.stdout.buffer, sys.stdin.buffer)
        return 0
    comm = from_mpi()
    if scenario == "kill":
        run_kill(comm, int(arg), prefix, Path(outdir))
        return 1
    device = torch.device("cpu")
    if arg == "cuda":
        index = comm.rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    try:
        everyone = run_exchange(comm, device, prefix)
    except BaseException:
        # Exit at once: the launcher then ends the job instead of letting the other
        # ranks wait out their collective timeouts.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    Path(outdir, f"result.{comm.rank}.json").write_text(json.dumps(everyone[comm.rank]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
