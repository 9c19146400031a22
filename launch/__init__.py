"""Launcher detection and torch.distributed bring-up.

``detect()`` says which launcher started this process (torchrun, Open MPI,
MPICH/Intel MPI, PMIx, Slurm ``srun``, or none) and where the process sits in the
job; it is pure and imports neither torch nor mpi4py. ``init_process_group()`` is the
one function that changes state: it brings up ``torch.distributed`` from whatever
launcher is present. ``python -m launch -- PROGRAM`` gives a program the torchrun
variables under any launcher.
"""

from __future__ import annotations

from launch._detect import LAUNCHERS, MPI_LAUNCHERS, LaunchError, LaunchInfo, detect
from launch._dist import gloo_group, init_process_group
from launch._nodelist import expand_nodelist

__all__ = [
    "LAUNCHERS",
    "MPI_LAUNCHERS",
    "LaunchError",
    "LaunchInfo",
    "detect",
    "expand_nodelist",
    "gloo_group",
    "init_process_group",
]



