"""Communicators: the seam between distcache's collectives and a process group.

``auto()`` adopts what the process already has (an initialised torch.distributed
group, else an MPI world when a launcher variable says MPI is in use), else returns a
world-size-1 :class:`LocalCommunicator`. Every caller that needs a communicator of
its own goes through :mod:`distcache.comm.adopt`, which holds that choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distcache.comm._announce import tell_others
from distcache.comm._base import MAX_MESSAGE_BYTES, Communicator, agree_on_error
from distcache.comm._bulk import BulkCommunicator, bulk_transport
from distcache.comm._local import LocalCommunicator, ThreadCommunicator, ThreadGroup
from distcache.comm._mpi import MpiCommunicator
from distcache.comm._tree import NodeTree, node_layout, node_tree, reduce_object
from distcache.comm.adopt import Adopted, adopt, auto
from distcache.errors import CommError

if TYPE_CHECKING:
    from distcache.comm._counting import CountingCommunicator, Traffic
    from distcache.comm._gloo import GlooCommunicator as GlooCommunicator
    from distcache.comm._torch import TorchCommunicator as TorchCommunicator

#: Names loaded on first use: torch's communicators import torch's pieces (and the
#: gloo one the launcher's store helpers), loaded by the jobs that adopt
#: torch.distributed; the counting wrapper by those that measure.
_LAZY = {"CountingCommunicator": "distcache.comm._counting",
         "Traffic": "distcache.comm._counting",
         "TorchCommunicator": "distcache.comm._torch",
         "GlooCommunicator": "distcache.comm._gloo"}

__all__ = [
    "MAX_MESSAGE_BYTES",
    "Adopted",
    "BulkCommunicator",
    "Communicator",
    "CountingCommunicator",
    "LocalCommunicator",
    "NodeTree",
    "ThreadCommunicator",
    "ThreadGroup",
    "Traffic",
    "adopt",
    "agree_on_error",
    "auto",
    "bulk_transport",
    "from_mpi",
    "from_torch",
    "local",
    "node_layout",
    "node_tree",
    "reduce_object",
    "tell_others",
]


def local(node_id: str | None = None) -> Communicator:
    """A world-size-1 communicator."""
    return LocalCommunicator(node_id)


def from_mpi(mpi_comm: Any = None, **kwargs: Any) -> Communicator:
    """distcache's own duplicate of an mpi4py communicator (default: ``COMM_WORLD``).
    Collective over ``mpi_comm``; ``close()`` frees the duplicate.

    Raises:
        CommError: mpi4py is not importable.
        CollectiveTimeout: not every rank of ``mpi_comm`` called it in time.
    """
    return MpiCommunicator(mpi_comm, **kwargs)


def from_torch(group: Any = None, **kwargs: Any) -> Communicator:
    """A communicator over torch.distributed. With no ``group``: a private gloo group
    of distcache's own on the default group's store (the default group itself is never
    used, so a distcache timeout cannot wedge it). With ``group``: that group, as the
    caller chose it.

    Raises:
        CommError: torch.distributed is not initialised, or the private group could
            not be made in time.
    """
    from distcache.comm._torch import TorchCommunicator, import_torch

    if group is not None:
        return TorchCommunicator(group, **kwargs)
    _, dist = import_torch()
    if not dist.is_initialized():
        raise CommError(
            "torch.distributed is not initialised; call init_process_group() first, or "
            "use distcache.comm.auto(), which needs no process group",
            op="init", backend="torch",
        )
    from torch.distributed import distributed_c10d

    from distcache.comm._gloo import GlooCommunicator

    store = distributed_c10d._get_default_store()
    return GlooCommunicator(store, dist.get_rank(), dist.get_world_size(), **kwargs)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
