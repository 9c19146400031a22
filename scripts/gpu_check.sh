#!/usr/bin/env bash
# GPU-machine check for what CI cannot run (it has no GPU): CUDA IPC pools between
# real processes, and the NCCL bulk transport. Prints a report; exits non-zero if any
# check fails; every check runs in its own process group under a hard timeout, all
# of them within 8 minutes.
#   scripts/gpu_check.sh            on a GPU machine
#   scripts/gpu_check.sh --syntax   anywhere: parse this script and compile its Python
#
# - same-device CUDA IPC between processes: the registry suite and the 1-producer /
#   3-consumer exchange on CudaPool, all ranks on one GPU;
# - scripts/gpu_ipc.py: a producer outside the consumers' group, consumers on the same
#   GPU (and one on another GPU when there are two), a table of us/feature for
#   cudaIpcOpenMemHandle+copy+cudaIpcCloseMemHandle per message against map-once
#   fetch and view, opens per consumer, and a check that put/fetch/view never wait
#   on the stream;
# - NCCL broadcast (init(transport="nccl")) only with two or more GPUs: NCCL refuses
#   two ranks on one GPU, so with one GPU it is a visible SKIP.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}; [ -x .venv/bin/python ] && PY=.venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONDONTWRITEBYTECODE=1

nccl_py=$(mktemp --suffix=.py); trap 'rm -f "$nccl_py"' EXIT
cat > "$nccl_py" <<'PY'
import hashlib, os, torch
from distcache.comm import auto, bulk_transport

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
comm = auto(timeout=60)  # distcache's own gloo group on torchrun's store
with bulk_transport(comm, "nccl", 60) as moving:
    payload = os.urandom(3 << 20) if comm.rank == 0 else None
    data = moving.broadcast_bytes(payload, 0, timeout=60)
    digests = moving.allgather_object(hashlib.sha256(data).hexdigest(), timeout=60)
assert len(set(digests)) == 1 and len(data) == 3 << 20, "NCCL broadcast differs across ranks"
print(f"rank {comm.rank}: NCCL broadcast of 3 MiB, digests agree", flush=True)
comm.close()
PY

if [ "${1:-}" = "--syntax" ]; then
  bash -n "$0" && "$PY" -m py_compile scripts/gpu_ipc.py "$nccl_py" && echo "gpu_check: syntax ok"
  exit
fi

report=(); failed=0
check() {  # check NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo; echo "== $name"
  if timeout -k 5 "$secs" setsid "$@"; then report+=("PASS  $name"); else report+=("FAIL  $name"); failed=1; fi
}

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "${gpus:-0}" -lt 1 ]; then echo "gpu_check: torch sees no CUDA device"; exit 2; fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'
MPIRUN=$(command -v mpirun || echo .venv/bin/mpirun)

check "registry suite on CudaPool, mpirun -n 2, same GPU" 120 env DISTCACHE_TEST_COMM=mpi \
  DISTCACHE_TEST_IPC_BACKEND=cuda "$MPIRUN" -n 2 --oversubscribe \
  "$PY" -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_ipc.py
# DISTCACHE_REQUIRE_CUDA=1: the cuda case fails rather than skips if CUDA is unusable.
check "exchange, 1 producer + 3 consumers, CudaPool, mpirun -n 4" 150 \
  env DISTCACHE_REQUIRE_CUDA=1 "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/unit/test_ipc_multiprocess.py -k "exchange and cuda"
check "outside producer, map once vs open+close per message, no host sync" 150 \
  "$PY" scripts/gpu_ipc.py --features 100 --timeout 140
if [ "$gpus" -ge 2 ]; then
  check "NCCL broadcast, torchrun x2" 60 \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 "$nccl_py"
else
  report+=("SKIP  NCCL broadcast: $gpus GPU (NCCL refuses two ranks on one GPU)")
fi

echo; echo "== gpu_check report"; printf '%s\n' "${report[@]}"
exit "$failed"
