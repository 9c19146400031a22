"""A stand-in for an engine that starts its workers itself through
``torch.multiprocessing`` (spawn). Neither it nor its workers call distcache.

``python spawn_parent.py NPROCS CHECKSUMS OUT_DIR``: each worker asks FlashInfer's
real ``get_artifact`` for every artifact of CHECKSUMS and writes
``OUT_DIR/worker<i>.json`` (see ``engine_worker.lookups``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.multiprocessing as mp

from tests.support.engine_worker import lookups


def worker(index: int, checksums: str, out_dir: str) -> None:
    result = lookups(checksums, [])
    Path(out_dir, f"worker{index}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    nprocs, checksums, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    mp.spawn(worker, args=(checksums, out_dir), nprocs=nprocs, join=True)
