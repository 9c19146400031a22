#!/usr/bin/env bash
# The README's first command: the demo job (4 ranks, 2 simulated nodes, local origin).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec python scripts/demo.py "$@"
