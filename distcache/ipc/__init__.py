"""IPC pools: producers lease features in shared memory (host or GPU), consumers map
every peer pool exactly once at init and resolve small refs to zero-copy views.

::

    pool = ShmPool(64 << 20)                     # or CudaPool(64 << 20, device)
    registry = PoolRegistry.exchange(comm, [pool])   # collective, once
    ref = pool.put(tensor)                       # None: pool full, send a copy
    send(ref.pack())                             # a few dozen bytes, no pickle
    with registry.view(FeatureRef.unpack(data)) as t:   # on a consumer
        use(t)                                   # acked on exit

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
