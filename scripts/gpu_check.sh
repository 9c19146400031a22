#!/usr/bin/env bash
# GPU-machine check (CI has no GPU): the CUDA IPC pool backend through the same
# registry suite as the host backend, with 2+ processes, the 1-producer/3-consumer
# exchange on CudaPool (tests/unit/test_ipc_multiprocess.py), and the NCCL bulk transport
# (init(transport="nccl")) when there is one GPU per rank. Prints a short report; exits non-zero if any check fails.
#   NPROC=2 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}; [ -x .venv/bin/python ] && PY=.venv/bin/python
NPROC=${NPROC:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONDONTWRITEBYTECODE=1
report=(); failed=0
check() {  # check NAME CMD...: run under a hard timeout in its own process group
  local name=$1; shift
  if timeout -k 10 600 setsid "$@"; then report+=("PASS  $name"); else report+=("FAIL  $name"); failed=1; fi
}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device"; exit 2
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'

if command -v mpirun >/dev/null || [ -x .venv/bin/mpirun ]; then
  MPIRUN=$(command -v mpirun || echo .venv/bin/mpirun)
  check "registry suite, CudaPool, mpirun -n $NPROC" env DISTCACHE_TEST_COMM=mpi \
    DISTCACHE_TEST_IPC_BACKEND=cuda "$MPIRUN" -n "$NPROC" --oversubscribe \
    "$PY" -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_ipc.py
  # 1 producer + 3 consumers, 10,000 features, CudaPool; DISTCACHE_REQUIRE_CUDA=1 makes
  # the cuda case fail rather than skip if CUDA turns out to be unusable.
  check "IPC exchange, 1 producer + 3 consumers, CudaPool, mpirun -n 4" \
    env DISTCACHE_REQUIRE_CUDA=1 "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/unit/test_ipc_multiprocess.py -k "exchange and cuda"
else
  report+=("FAIL  registry suite, CudaPool: no mpirun on this machine"); failed=1
fi

script=$(mktemp --suffix=.py); trap 'rm -f "$script"' EXIT
cat > "$script" <<'PY'
import hashlib, os, time, torch, torch.distributed as dist
from distcache.comm import auto, bulk_transport
from distcache.ipc import CudaPool, FeatureRef, PoolRegistry
from distcache.ipc._cuda import CudaMapping

dev = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
torch.cuda.set_device(dev)
comm = auto(timeout=120)  # distcache's own gloo group on torchrun's store
assert comm.backend == "gloo" and not dist.is_initialized(), comm
if torch.cuda.device_count() >= comm.size:
    # init(transport="nccl"): bulk bytes over a dedicated NCCL group, closed after.
    with bulk_transport(comm, "nccl", 120) as moving:
        payload = os.urandom(3 << 20) if comm.rank == 0 else None
        data = moving.broadcast_bytes(payload, 0, timeout=120)
        digests = moving.allgather_object(hashlib.sha256(data).hexdigest(), timeout=120)
    assert len(set(digests)) == 1 and len(data) == 3 << 20, "NCCL broadcast differs across ranks"
    print(f"rank {comm.rank}: NCCL transport broadcast 3 MiB, digests agree", flush=True)
else:
    print(f"rank {comm.rank}: SKIP NCCL transport: {torch.cuda.device_count()} GPU(s) for "
          f"{comm.size} ranks (NCCL refuses two ranks on one GPU)", flush=True)

pool = CudaPool(32 << 20, dev, name=f"gpu{comm.rank}")
reg = PoolRegistry.exchange(comm, [pool], timeout=120)
assert reg.backend == "cuda", reg.backend
mine = [pool.put(torch.full((1024,), float(comm.rank * 1000 + i), device=dev)) for i in range(200)]
everyone = comm.allgather_object([r.pack() for r in mine], timeout=120)
peer_src = (comm.rank + 1) % comm.size
refs = [FeatureRef.unpack(b) for b in everyone[peer_src]]
t0 = time.perf_counter()
for i, ref in enumerate(refs[:100]):
    with reg.view(ref) as t:
        assert t.device.index == dev and t[0].item() == peer_src * 1000 + i
once = (time.perf_counter() - t0) / 100
for src, packed in enumerate(everyone):  # other peers (size > 2) ack without reading
    if src not in (comm.rank, peer_src):
        for b in packed:
            reg.ack(FeatureRef.unpack(b))
opens, desc = dict(reg.opens), reg._entries[f"gpu{peer_src}"].descriptor
torch.cuda.synchronize(); reg.close()  # unmapped: each open below really maps the pool again
t0 = time.perf_counter()
for i, ref in enumerate(refs[100:]):  # the anti-pattern: open + close per feature
    m = CudaMapping(desc, dev)
    assert m.view(ref.offset, ref.nbytes).view(torch.float32)[0].item() == peer_src * 1000 + 100 + i
    m.words.set(ref.slot * (1 + desc.ack_words) + 1 + desc.consumers.index(comm.rank), ref.generation)
    torch.cuda.synchronize(); m.close(); del m
per = (time.perf_counter() - t0) / 100
torch.cuda.synchronize(); comm.barrier(timeout=120)
assert pool.reclaim() == 200 and pool.in_flight == 0, pool.in_flight
assert opens == {f"gpu{r}": 1 for r in range(comm.size) if r != comm.rank}, opens
print(f"rank {comm.rank}: {once * 1e6:.1f} us/feature mapped once (resolve+ack), "
      f"{per * 1e6:.1f} us/feature open+close per message; opens {opens}", flush=True)
comm.barrier(timeout=120); pool.close(); comm.close()
PY
check "NCCL transport (2+ GPUs, else a visible skip) + CUDA IPC registry, torchrun x$NPROC" \
  "$PY" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" "$script"

echo; echo "== gpu_check report"; printf '%s\n' "${report[@]}"
exit "$failed"
