"""Launcher detection and torch.distributed bring-up.

``detect()`` says which launcher started this process (torchrun, Open MPI,
MPICH/Intel MPI, PMIx, Slurm ``srun``, or none) and where the process sits in the
job; it is pure and imports neither torch nor mpi4py. ``init_process_group()`` is the
one function that changes state: it brings up ``torch.distributed`` from whatever
launcher is present. ``python -m launch -- PROGRAM`` gives a program the torchrun
variables under any launcher.

Errors come from the library's one error tree (:mod:`distcache.errors`):
:class:`LaunchError` for a missing, malformed or inconsistent launcher environment,
:class:`WorkspaceError` for a per-rank workspace slot that cannot be held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distcache.errors import LaunchError, WorkspaceError
from launch._detect import LAUNCHERS, MPI_LAUNCHERS, LaunchInfo, detect
from launch._nodelist import expand_nodelist
from launch._sources import run_id

if TYPE_CHECKING:
    from launch._dist import gloo_group, init_process_group, publish_store, rendezvous_address
    from launch._rendezvous import Rendezvous, find_store

#: Names loaded on first use: torch's bring-up and the rendezvous store are for the
#: jobs that use torch.distributed, not for every process that detects its launcher.
_LAZY = {"gloo_group": "launch._dist", "init_process_group": "launch._dist",
         "publish_store": "launch._dist", "rendezvous_address": "launch._dist",
         "Rendezvous": "launch._rendezvous", "find_store": "launch._rendezvous"}

__all__ = [
    "LAUNCHERS",
    "MPI_LAUNCHERS",
    "LaunchError",
    "LaunchInfo",
    "Rendezvous",
    "WorkspaceError",
    "detect",
    "expand_nodelist",
    "find_store",
    "gloo_group",
    "init_process_group",
    "publish_store",
    "rendezvous_address",
    "run_id",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
