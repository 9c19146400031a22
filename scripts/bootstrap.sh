#!/usr/bin/env bash
# Create or update the project-local virtual environment, idempotently.
# torch is installed first and pinned: a bare `torch` requirement in a fresh
# environment would resolve to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC="torch==2.13.0"
DIST="distcache-kernels"
EXTRAS="torch,mpi,test,bench,flashinfer"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi

# Re-install only when the dependency declaration changed.
want=$( { cat pyproject.toml setup.py distcache-autoinstall.pth; echo "$TORCH_SPEC $EXTRAS"; } \
        | sha256sum | cut -c1-16)
stamp=".venv/.installed-$want"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing $TORCH_SPEC, then $DIST[$EXTRAS] (editable)"
  # The distribution was called "distcache" before; both would claim the same package.
  if .venv/bin/python -m pip show --quiet distcache >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall --quiet --yes distcache
  fi
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
  # A wheel puts the start-up hook into site-packages; an editable install does not.
  purelib=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  cp distcache-autoinstall.pth "$purelib/"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
