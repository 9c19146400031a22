"""IPC pools: producers lease features in shared memory (host or GPU), consumers map
every peer pool exactly once and take small refs by copy (``fetch``) or view.

::

    pool = ShmPool(64 << 20)                     # or CudaPool(64 << 20, device)
    registry = PoolRegistry.exchange(comm, [pool])   # collective, once
    ref = pool.put(tensor, consumers=[3])        # None: full for now; [3]: rank 3 reads it
    send(ref.pack())                             # a few dozen bytes, no pickle
    t = registry.fetch(FeatureRef.unpack(data))  # on rank 3: its own copy, then the ack
    with registry.view(ref) as t: ...            # or zero-copy, acked on exit

A producer outside the consumers' communicator binds its pool with ``owner=None``
and sends ``pool.descriptor().pack()`` over any channel; consumers map it once with
``registry.add(data)``.

torch is imported lazily: importing this package does not load it.
"""

from __future__ import annotations

from distcache.ipc._cuda import CudaPool
from distcache.ipc._descriptor import PoolDescriptor
from distcache.ipc._probe import probe_cuda_ipc
from distcache.ipc._ref import FeatureRef
from distcache.ipc._registry import PoolRegistry
from distcache.ipc._shm import ShmPool

__all__ = [
    "CudaPool",
    "FeatureRef",
    "PoolDescriptor",
    "PoolRegistry",
    "ShmPool",
    "probe_cuda_ipc",
]
