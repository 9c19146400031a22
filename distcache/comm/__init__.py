"""Communicators: the seam between distcache's collectives and a process group.

``auto()`` adopts what the process already has (an initialised torch.distributed
group, else an MPI world when a launcher variable says MPI is in use), else returns a
world-size-1 :class:`LocalCommunicator`. Every caller that needs a communicator of
its own goes through :mod:`distcache.comm.adopt`, which holds that choice.
"""

from __future__ import annotations

from typing import Any

from distcache.comm._base import MAX_MESSAGE_BYTES, Communicator, agree_on_error
from distcache.comm._local import LocalCommunicator, ThreadCommunicator, ThreadGroup
from distcache.comm.adopt import Adopted, adopt, auto

__all__ = [
    "MAX_MESSAGE_BYTES",
    "Adopted",
    "Communicator",
    "LocalCommunicator",
    "ThreadCommunicator",
    "ThreadGroup",
    "adopt",
    "agree_on_error",
    "auto",
    "from_mpi",
    "from_torch",
    "local",
]


def local(node_id: str | None = None) -> Communicator:
    """A world-size-1 communicator."""
    return LocalCommunicator(node_id)


def from_mpi(mpi_comm: Any = None, **kwargs: Any) -> Communicator:
    """Wrap an mpi4py communicator (default: ``COMM_WORLD``).

    Raises:
        CommError: mpi4py is not importable.
    """
    from distcache.comm._mpi import MpiCommunicator

    return MpiCommunicator(mpi_comm, **kwargs)


def from_torch(group: Any = None, **kwargs: Any) -> Communicator:
    """Wrap an initialised torch.distributed process group (default: the world).

    Raises:
        CommError: torch.distributed is not initialised.
    """
    from distcache.comm._torch import TorchCommunicator

    return TorchCommunicator(group, **kwargs)
