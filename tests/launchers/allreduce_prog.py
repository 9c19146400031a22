"""Bring up gloo through launch.init_process_group() and print one all-reduce.

Run under mpirun, torchrun, srun or a network namespace: each rank prints one line
``RESULT <launcher> <rank> <world_size> <sum>`` where ``sum`` is the all-reduce of
``rank + 1`` over the world.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import launch


def main() -> int:
    info = launch.init_process_group(backend="gloo", timeout=60)
    value = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(value, group=launch.gloo_group())
    print(f"RESULT {info.launcher} {info.rank} {info.world_size} {int(value.item())}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
