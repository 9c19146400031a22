"""A key-value store every rank of the job can reach, found without any collective.

distcache's private gloo groups rendezvous here, never on the engine's process group:

* the engine already initialised torch.distributed -- its default store, under a
  prefix of distcache's own (reading the store is not a collective on the group);
* torchrun -- the agent's store at ``MASTER_ADDR:MASTER_PORT``
  (``TORCHELASTIC_USE_AGENT_STORE=True``): every rank is a client, so the engine's own
  ``env://`` rendezvous later finds the port as it expects;
* Slurm ``srun`` or ``python -m launch`` -- rank 0 hosts a store one port above
  ``MASTER_PORT``, so the engine's ``env://`` rendezvous on ``MASTER_PORT`` itself stays
  free for the engine.

Under MPI distcache uses a duplicate of the MPI world instead and needs no store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from distcache.errors import CommError, LaunchError
from launch._detect import LaunchInfo

log = logging.getLogger(__name__)

#: Offset from ``MASTER_PORT`` of the store rank 0 hosts when no agent hosts one.
PORT_OFFSET = 1


@dataclass(frozen=True)
class Rendezvous:
    """A store shared by the job's ranks, and this process's place among them."""

    store: Any
    rank: int
    world_size: int
    #: Where the store came from, for logs: "default group", "torchrun agent", ...
    source: str


def find_store(
    info: LaunchInfo, timeout: float, environ: Mapping[str, str] | None = None
) -> Rendezvous:
    """The job's rendezvous store, reached without a collective on any group.

    Raises:
        LaunchError: the launcher gives no address to meet at (no ``MASTER_ADDR`` /
            ``MASTER_PORT`` and no initialised torch.distributed).
        CommError: the store cannot be reached or hosted within ``timeout``.
    """
    import torch.distributed as dist

    env = os.environ if environ is None else environ
    wait = timedelta(seconds=timeout)
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        return Rendezvous(distributed_c10d._get_default_store(), dist.get_rank(),
                          dist.get_world_size(), "the engine's default store")
    if info.master_addr is None or info.master_port is None:
        raise LaunchError(
            f"{info.launcher} started {info.world_size} ranks but gives no rendezvous "
            "address; set MASTER_ADDR and MASTER_PORT (or launch under torchrun or mpirun)",
            variable="MASTER_ADDR", value=info.master_addr,
        )
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    port = info.master_port if agent else info.master_port + PORT_OFFSET
    host_it = not agent and info.rank == 0
    try:
        store = dist.TCPStore(info.master_addr, port, info.world_size, host_it,
                              timeout=wait, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        role = "host" if host_it else "reach"
        raise CommError(
            f"rank {info.rank}/{info.world_size}: cannot {role} the rendezvous store at "
            f"{info.master_addr}:{port}: {exc}; check that the port is free on rank 0's "
            "host and reachable from every node",
            op="rendezvous", rank=info.rank, backend="gloo",
        ) from exc
    source = "torchrun agent store" if agent else f"store hosted by rank 0 on port {port}"
    log.debug("rendezvous: %s at %s:%d", source, info.master_addr, port)
    return Rendezvous(store, info.rank, info.world_size, source)
