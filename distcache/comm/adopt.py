"""Choose a communicator for this process without starting anything new.

Order: an initialised torch.distributed world (the engine already built one), else
MPI when this process was launched by an MPI runtime or already imported mpi4py,
else a world-size-1 :class:`~distcache.comm._local.LocalCommunicator`.

Nothing here imports torch or mpi4py to find out: importing torch costs seconds, and
importing ``mpi4py.MPI`` calls ``MPI_Init``, which hangs or aborts outside an MPI
launch. torch is consulted only when it is already in ``sys.modules``; MPI is detected
from launcher variables.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from distcache.comm._base import Communicator
from distcache.comm._local import LocalCommunicator
from distcache.config import settings

__all__ = ["auto", "launcher_is_mpi", "torch_is_initialised"]

log = logging.getLogger(__name__)

_OPTIONS = frozenset({"timeout", "chunk_bytes", "node_id"})
# Used only when the launch package is unavailable: one variable per MPI runtime.
_MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def torch_is_initialised() -> bool:
    """True when torch is already imported and its default process group is up."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def launcher_is_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPI runtime launched this process (so ``MPI_Init`` will succeed).

    Raises:
        LaunchError: the launcher variables contradict each other.
    """
    env = os.environ if environ is None else environ
    try:
        from launch import detect
    except ImportError:
        return any(name in env for name in _MPI_VARIABLES)
    info = detect(env)
    if not info.is_mpi and info.world_size > 1:
        log.warning(
            "launcher %s started %d ranks but torch.distributed is not initialised; "
            "distcache collectives stay local to each rank (call "
            "launch.init_process_group() first to share downloads)",
            info.launcher,
            info.world_size,
        )
    return info.is_mpi


def auto(**options: Any) -> Communicator:
    """Adopt torch.distributed if initialised, else MPI when launched under MPI (or
    when mpi4py is already imported), else a local communicator.

    ``options`` (``timeout``, ``chunk_bytes``, ``node_id``) go to the backend chosen;
    a local communicator uses only ``node_id``.

    Raises:
        TypeError: an unknown option.
        CommError: MPI was detected but mpi4py cannot be used.
        LaunchError: the launcher variables contradict each other.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"auto() got unknown option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    if torch_is_initialised():
        from distcache.comm._torch import TorchCommunicator

        log.debug("adopting the initialised torch.distributed world")
        return TorchCommunicator(**options)
    if "mpi4py.MPI" in sys.modules or launcher_is_mpi():
        from distcache.comm._mpi import MpiCommunicator

        log.debug("adopting the MPI world")
        return MpiCommunicator(**options)
    node_id = options.get("node_id")
    if node_id is None:
        node_id = settings().node_id
    return LocalCommunicator(node_id)
