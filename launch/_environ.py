"""The environment ``python -m launch`` gives PROGRAM: torchrun's variables, as the
launcher that started the wrapper places this rank (:mod:`launch.__main__`)."""

from __future__ import annotations

import logging

from launch._detect import LaunchInfo

log = logging.getLogger("launch")

#: torchrun's node variables: PROGRAM's own :func:`launch.detect` reads them as torchrun's
#: once the wrapper exports ``RANK``, so a stale one is never passed on.
NODE_VARIABLES = ("GROUP_RANK", "GROUP_WORLD_SIZE")


def child_environment(
    info: LaunchInfo, base: dict[str, str], extra: dict[str, str]
) -> dict[str, str]:
    """The environment PROGRAM runs with: ``base`` plus the torchrun variables.

    ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (the node's index and the node count, as
    torchrun exports them) are the launcher's where it says, and are removed where it
    does not: left from another job (a torchrun worker's shell) under ``srun`` or
    ``mpirun``, which the wrapper ignores for want of ``RANK``, they would contradict
    the launcher in PROGRAM, which finds the ``RANK`` the wrapper exports beside them.
    """
    env = dict(base)
    values = {
        "RANK": info.rank,
        "WORLD_SIZE": info.world_size,
        "LOCAL_RANK": info.local_rank,
        "LOCAL_WORLD_SIZE": info.local_world_size,
        "GROUP_RANK": info.node_rank,
        "GROUP_WORLD_SIZE": info.num_nodes,
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": info.master_port,
    }
    for name, value in {**values, **extra}.items():
        if value is None:
            if name in NODE_VARIABLES and env.pop(name, None) is not None:
                log.debug("not passing on %s: %s gives no such value", name, info.launcher)
            continue
        if env.get(name) != str(value):
            log.debug("exporting %s=%s", name, value)  # the handler tags the rank
        env[name] = str(value)
    return env
