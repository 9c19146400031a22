"""The soak needs ``mpirun`` beside this interpreter (or on PATH) and 4 ranks'
worth of oversubscription; it mounts a small tmpfs for the full-disk fault when it
runs as root and does without that fault otherwise (the figures say which)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.support.process import mpirun


@pytest.fixture
def soak_seed() -> int:
    """``DISTCACHE_SOAK_SEED`` replays a schedule; the default is fixed so CI is
    reproducible, and every failure message carries the seed."""
    return int(os.environ.get("DISTCACHE_SOAK_SEED", "20240611"))


@pytest.fixture
def soak_workdir(tmp_path: Path) -> Path:
    if shutil.which(mpirun()) is None and not Path(mpirun()).exists():
        pytest.fail("mpirun is not installed; the soak cannot run")
    return tmp_path
