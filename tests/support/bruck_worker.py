"""One rank of the large-communicator all-gather test (``tests/multinode/test_mpi_bruck.py``).

    bruck_worker.py --out DIR

On distcache's MPI communicator (above ``BRUCK_ABOVE`` ranks, all-gathers go point to
point), every rank all-gathers payloads of sizes that differ per rank (empty ones
included), a nested object, and splits; then every rank but the last all-gathers on a
fresh communicator the last rank never joins, which must time out on each of them.
Writes what it saw as ``OUT/rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from mpi4py import MPI

from distcache.comm import CountingCommunicator, from_mpi
from distcache.comm._mpi import BRUCK_ABOVE
from distcache.errors import CollectiveTimeout


def payload(rank: int, call: int) -> bytes:
    """Rank ``rank``'s bytes in call ``call``: 0 to a few KiB, different per rank."""
    return bytes((rank * 31 + call + i) % 251 for i in range((rank * 97 + call * 13) % 3000))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    comm = CountingCommunicator(from_mpi(timeout=120))
    rank, size = comm.rank, comm.size
    seen: dict[str, Any] = {"rank": rank, "size": size, "bruck": size > BRUCK_ABOVE}
    right = True
    for call in range(5):
        got = comm.allgather_object(payload(rank, call))
        right = right and got == [payload(r, call) for r in range(size)]
    nested = comm.allgather_object({"rank": rank, "parts": [rank] * (rank % 4), "none": None})
    right = right and nested == [{"rank": r, "parts": [r] * (r % 4), "none": None}
                                 for r in range(size)]
    half = comm.split(rank % 2)
    right = right and half.allgather_object(rank) == list(range(rank % 2, size, 2))
    seen["right"] = right
    seen["received"] = comm.traffic.received
    # A fresh communicator that the last rank never uses: the others time out on it.
    doomed = from_mpi(MPI.COMM_WORLD, timeout=120)
    if rank != size - 1:
        began = time.monotonic()
        try:
            doomed.allgather_object(b"x" * rank, timeout=2.0)
            seen["timeout"] = "none"
        except CollectiveTimeout as exc:
            seen["timeout"] = type(exc).__name__
            seen["timeout_s"] = round(time.monotonic() - began, 2)
    MPI.COMM_WORLD.Barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
