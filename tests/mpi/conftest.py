"""Fixtures for the suite that runs under ``mpirun -n N python -m pytest --with-mpi``.

``DISTCACHE_TEST_COMM`` selects the backend every test body runs on:

* ``mpi`` (default): distcache's own duplicate of ``COMM_WORLD`` (``comm.from_mpi``);
* ``torch``: distcache's own gloo group (``comm.from_torch``) on the store of a default
  group brought up by ``launch.init_process_group`` (under MPI, rank 0 opens a
  ``TCPStore`` on an OS-chosen port and the address travels over MPI, so parallel
  jobs never race for a port).

Fixtures: ``comm`` (session-wide), ``comm_factory`` (a new communicator over the same
ranks with other options, e.g. a small ``chunk_bytes``) and ``shared_tmp`` (one fresh
directory whose path is identical on every rank).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache.comm import Communicator
from launch import init_process_group

BACKENDS = ("mpi", "torch")
_BRINGUP_TIMEOUT_S = 120.0


# The temporary root this conftest made for the run (removed at its end).
_OWN_BASETEMP = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """A temporary root of this rank's own: the ranks of one job all run pytest at
    once, and pytest's numbered directories under one shared root race (one rank
    removes an old directory while another lists them: an unclosed scandir iterator,
    an error under ``filterwarnings = error``)."""
    if config.option.basetemp is None:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
        config.option.basetemp = tempfile.mkdtemp(prefix=f"distcache-mpi-rank{rank}-")
        config.stash[_OWN_BASETEMP] = config.option.basetemp


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_BASETEMP, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)



def selected_backend() -> str:
    backend = os.environ.get("DISTCACHE_TEST_COMM", "mpi")
    if backend not in BACKENDS:
        raise pytest.UsageError(f"DISTCACHE_TEST_COMM={backend!r}; use one of {BACKENDS}")
    return backend


def _init_torch_gloo() -> None:
    """Bring up torch.distributed (gloo) over the MPI world, unless it is up already."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    init_process_group(backend="gloo", timeout=_BRINGUP_TIMEOUT_S)


def _make(backend: str, base: Communicator | None = None, **options: Any) -> Communicator:
    if backend == "mpi":
        from distcache.comm import from_mpi

        handle = None if base is None else getattr(base, "mpi_comm", None)
        return from_mpi(handle, **options)
    from distcache.comm import from_torch

    # distcache's own gloo group on the default group's store, as init makes it; the
    # default group stays the "engine's".
    _init_torch_gloo()
    return from_torch(**options)


@pytest.fixture(scope="session")
def comm() -> Iterator[Communicator]:
    """The world communicator of the selected backend."""
    backend = selected_backend()
    world = _make(backend)
    yield world
    if backend == "torch":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def comm_factory(comm: Communicator) -> Callable[..., Communicator]:
    """``comm_factory(**options)``: a new communicator over the same ranks as ``comm``.

    Collective: every rank must call it with the same options.
    """

    def factory(**options: Any) -> Communicator:
        return _make(selected_backend(), comm, **options)

    return factory


@pytest.fixture
def shared_tmp(comm: Communicator) -> Iterator[Path]:
    """A fresh directory, the same path on every rank; removed after the test."""
    made = tempfile.mkdtemp(prefix="distcache-mpi-") if comm.rank == 0 else ""
    path = Path(comm.broadcast_bytes(made.encode() if comm.rank == 0 else None, 0).decode())
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
