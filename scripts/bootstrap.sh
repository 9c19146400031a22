#!/usr/bin/env bash
# Create or update the project-local virtual environment, idempotently.
# torch is installed first and pinned: a bare `torch` requirement in a fresh
# environment would resolve to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC="torch==2.13.0"
EXTRAS="mpi,test,bench,flashinfer"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi

# Re-install only when the dependency declaration changed.
want=$( { cat pyproject.toml; echo "$TORCH_SPEC $EXTRAS"; } | sha256sum | cut -c1-16)
stamp=".venv/.installed-$want"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing $TORCH_SPEC, then distcache[$EXTRAS] (editable)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
