"""The one way any caller gets a communicator: :func:`adopt`.

``comm.auto()``, ``distcache.init``, ``python -m launch --prefetch`` and ``distcache
prefetch`` all come here; :func:`choose` is the whole policy, so a new kind of
communicator is a change to that one function.

The order: an initialised torch.distributed world (the engine already built one),
else MPI when an MPI runtime launched this job of several ranks (or mpi4py is already
imported in a single process), else, for several ranks under another launcher and
when the caller allows it, torch.distributed brought up through
:func:`launch.init_process_group`, else a world-size-1
:class:`~distcache.comm.LocalCommunicator`. A world of one rank never starts a
runtime.

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
from dataclasses import dataclass
from typing import Any, Literal

from distcache.comm._base import Communicator
from distcache.comm._local import LocalCommunicator
from distcache.config import settings
from launch import LaunchInfo, detect, init_process_group

__all__ = ["Adopted", "Choice", "adopt", "auto", "choose", "launcher_is_mpi",
           "torch_is_initialised"]

log = logging.getLogger(__name__)

_OPTIONS = frozenset({"timeout", "chunk_bytes", "node_id"})

#: ``"torch"``: adopt the initialised world; ``"mpi"``: the MPI world;
#: ``"torch-new"``: bring torch.distributed up for this launch; ``"local"``: one rank.
Choice = Literal["torch", "mpi", "torch-new", "local"]


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
    return detect(os.environ if environ is None else environ).is_mpi


def choose(info: LaunchInfo, *, bring_up: bool) -> Choice:
    """Which communicator this process gets: the whole policy, pure but for looking at
    ``sys.modules``. ``bring_up`` allows starting torch.distributed for a multi-rank
    launch that has neither a torch group nor MPI."""
    if torch_is_initialised():
        return "torch"
    if info.is_mpi and info.world_size > 1:
        return "mpi"
    if "mpi4py.MPI" in sys.modules and info.world_size == 1:
        return "mpi"
    if info.world_size > 1:
        if bring_up:
            return "torch-new"
        log.warning(
            "launcher %s started %d ranks but torch.distributed is not initialised; "
            "distcache collectives stay local to each rank (call "
            "launch.init_process_group() first to share downloads)",
            info.launcher,
            info.world_size,
        )
    return "local"


@dataclass
class Adopted:
    """A communicator and whether :func:`adopt` brought torch.distributed up for it.

    Call :meth:`close` when done: it tears down what :func:`adopt` started (a process
    exiting with a live gloo group may abort in its destructor) and nothing else.
    """

    comm: Communicator
    choice: Choice
    owns_process_group: bool = False

    def close(self) -> None:
        """Destroy the process group :func:`adopt` created, if any; idempotent."""
        if not self.owns_process_group:
            return
        self.owns_process_group = False
        import torch.distributed as dist  # only reached after adopt() imported torch

        if dist.is_initialized():
            dist.destroy_process_group()


def adopt(
    info: LaunchInfo | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    bring_up: bool = False,
    **options: Any,
) -> Adopted:
    """Find or make this process's communicator (see :func:`choose`).

    Args:
        info: the launch (default: :func:`launch.detect` of ``environ``).
        environ: the environment to detect from (default ``os.environ``).
        bring_up: allow bringing torch.distributed up for a multi-rank launch.
        options: ``timeout``, ``chunk_bytes``, ``node_id`` for the backend chosen; a
            local communicator uses only ``node_id``.

    Raises:
        TypeError: an unknown option.
        CommError: the backend chosen cannot be used (mpi4py missing, say).
        LaunchError: the launcher variables contradict each other, or the rendezvous
            is incomplete.
        CollectiveTimeout: bringing torch.distributed up timed out.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    if info is None:
        info = detect(os.environ if environ is None else environ)
    choice = choose(info, bring_up=bring_up)
    if choice == "torch-new":
        init_process_group(info)
    if choice in ("torch", "torch-new"):
        from distcache.comm._torch import TorchCommunicator  # imports torch

        log.debug("communicator: torch.distributed (%s)", choice)
        return Adopted(TorchCommunicator(**options), choice, choice == "torch-new")
    if choice == "mpi":
        from distcache.comm._mpi import MpiCommunicator  # importing mpi4py calls MPI_Init

        log.debug("communicator: the MPI world")
        return Adopted(MpiCommunicator(**options), choice)
    node_id = options.get("node_id")
    if node_id is None:
        node_id = settings().node_id
    return Adopted(LocalCommunicator(node_id), choice)


def auto(**options: Any) -> Communicator:
    """Adopt what the process already has, never starting torch.distributed: see
    :func:`adopt` with ``bring_up=False``.

    Raises:
        TypeError: an unknown option.
        CommError: MPI was detected but mpi4py cannot be used.
        LaunchError: the launcher variables contradict each other.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    return adopt(**options).comm
